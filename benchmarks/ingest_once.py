"""``python -m benchmarks.ingest_once [--quick] [--rows N] [--only cached,computed,plain,cv]``:
fit many, ingest once (issue 26). The first three fits of a run, with the rows kept between
fits (``keepIngestedMB``) and without, against pyarrow's read, on three DataFrames over one
Parquet file: cached, computed and plain; then a ``CrossValidator`` on the cached one.

The cached DataFrame is a cache of the table's own plan, so ``spark.read.parquet`` of that
path reads the cache while it lasts; the computed and plain scenarios read the same file
under another path (a hard link), which no cache covers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import logging
import os
import tempfile
import time

from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql import functions as F

from benchmarks.common import Probe, Workload, markdown, register_by_value, spark_session, write_data
from benchmarks.contenders import estimator, pyarrow

#: One file of 1M-row row groups; an MLP 32-64-64-1, batches of 512, fits of one step.
WORKLOAD = Workload(rows=4_000_000, features=32, hidden=64, batch_size=512, epochs=1000, files=0)


def kept_on_disk(scratch: str) -> int:
    """MB the executors keep under the session's local directory, ``<scratch>/local``."""
    kept = glob.glob(os.path.join(scratch, "local", "*", "spark_torch_est-kept", "*", "*"))
    return round(sum(os.path.getsize(file) for file in kept) / 2 ** 20)


def three_fits(df, keep_mb: float, scratch: str) -> list[dict]:
    """The first three fits of one run (one step each) on ``df``: rank 0's first step, and each
    rank's RSS and its process's peak so far at its first step (the workers serve every fit)."""
    probe = Probe(scratch, "fit")
    est = estimator(WORKLOAD, [probe], keepIngestedMB=keep_mb)
    fits = []
    for _ in range(3):
        called = time.time()
        est.fit(df, duration="1ba")
        done_s = time.time() - called
        ranks = probe.reports(WORKLOAD.ranks)
        fits.append({"first_step_s": round(ranks[0]["fit_first"] - called, 2), "done_s": round(done_s, 2),
                     "rss_mb": [round(rank["first_step_rss_mb"]) for rank in ranks],
                     "peak_mb": [round(rank["first_step_lifetime_peak_mb"]) for rank in ranks],
                     "kept_mb": kept_on_disk(scratch)})
    return fits


def cross_validation(df, keep_mb: float, scratch: str) -> dict:
    """A CrossValidator of 2 folds x 2 maps (one epoch per fit), then its refit: its time, its
    training jobs (a fold's maps train in one), the fits on rows kept by an earlier job."""
    est = estimator(WORKLOAD, [], keepIngestedMB=keep_mb, maxEpochs=1)  # each fit trains one epoch of its fold
    configs = [WORKLOAD.config, {**WORKLOAD.config, "lr": 0.001}]
    grid = ParamGridBuilder().addGrid(est.getParam("config"), configs).build()
    reused = _Count("kept this DataFrame's rows")  # the driver's log line of a fit on kept rows
    jobs = _Count("launching training job")
    log = logging.getLogger("spark_torch_est.fit")  # the fit's own log (docs/reliability.md, its loggers)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(reused)
    log.addHandler(jobs)
    started = time.time()
    try:
        CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=0, parallelism=1,
                       evaluator=RegressionEvaluator(labelCol="label", predictionCol="prediction")).fit(df)
    finally:
        log.removeHandler(reused)
        log.removeHandler(jobs)
        log.setLevel(level)
    return {"total_s": round(time.time() - started, 1), "jobs": jobs.count, "fits_on_kept_rows": reused.count,
            "kept_mb": kept_on_disk(scratch)}


class _Count(logging.Handler):
    """Counts the log records that contain ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.INFO)
        self.text, self.count = text, 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += self.text in record.getMessage()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ingest_once",
                                     description="Fit many, ingest once: kept rows against pyarrow's read")
    parser.add_argument("--quick", action="store_true", help="200k rows instead of 4M")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--only", default="cached,computed,plain,cv",
                        help="comma-separated scenarios among cached, computed, plain, cv (default: all)")
    args = parser.parse_args()
    rows = args.rows or (200_000 if args.quick else 4_000_000)
    register_by_value()
    with tempfile.TemporaryDirectory(prefix="ingest_once-", ignore_cleanup_errors=True) as scratch:
        workload = write_data(dataclasses.replace(WORKLOAD, rows=rows), scratch)
        # 4 GB: the 4M-row cache (about 520 MB) and a fold's caches besides it; under the default
        # 1 GB the CrossValidator's shuffles thrash for many minutes.
        conf = {"spark.driver.memory": "4g", "spark.local.dir": os.path.join(scratch, "local")}
        with spark_session(2, "bench-ingest-once", **conf) as spark:
            results = _scenarios(spark, workload, args.only.split(","), scratch)
    print(json.dumps(results, indent=1))
    _table(results)


def _scenarios(spark, workload: Workload, only: list[str], scratch: str) -> dict:
    table = workload.path
    results: dict = {"rows": workload.rows, "load_average": os.getloadavg()[0], "pyarrow_s": []}
    plain = os.path.join(scratch, "plain")  # the same file under another path: no cache of the table covers it
    os.makedirs(plain)
    os.link(os.path.join(table, "part-0.parquet"), os.path.join(plain, "part-0.parquet"))
    cached = spark.read.parquet(table).cache()
    if "cached" in only or "cv" in only:
        started = time.time()
        cached.count()
        results["cache_fill_s"] = round(time.time() - started, 1)
    computed = spark.read.parquet(plain).filter(F.col("label") > -1e30).withColumn("label", F.col("label") * 2)
    scenarios = {"cached": functools.partial(three_fits, cached), "computed": functools.partial(three_fits, computed),
                 "plain": functools.partial(three_fits, spark.read.parquet(plain)),
                 "cv": functools.partial(cross_validation, cached)}
    warm_up = spark.read.parquet(table).limit(1000)
    estimator(WORKLOAD, [], keepIngestedMB=0).fit(warm_up, duration="1ba")  # starts the Python workers
    for name, run in scenarios.items():
        if name not in only:
            continue
        if name != "cv":
            results["pyarrow_s"].append(round(pyarrow(workload, scratch)["read_s"], 2))
        for label, keep_mb in (("before", 0.0), ("after", 8192.0)):
            results[f"{name}/{label}"] = run(keep_mb, scratch)
            print(json.dumps({f"{name}/{label}": results[f"{name}/{label}"]}), flush=True)
    results["pyarrow_s"].append(round(pyarrow(workload, scratch)["read_s"], 2))
    return results


def _table(results: dict) -> None:
    read_s, reads = min(results["pyarrow_s"]), len(results["pyarrow_s"])
    print(f"\n{results['rows']:,} rows x {WORKLOAD.features} float32, local[2], load average "
          f"{results['load_average']:.1f}; pyarrow reads the table in {read_s:.2f} s (best of {reads})")
    rows = [[*key.split("/"), *[f"{fit['first_step_s']:.2f} s" for fit in fits],
             f"{fits[1]['first_step_s'] / read_s:.1f}x", f"{fits[1]['rss_mb']} (peak {fits[1]['peak_mb']})",
             f"{fits[-1]['kept_mb']} MB"] for key, fits in results.items() if "/" in key and not key.startswith("cv/")]
    header = ["DataFrame", "keeping", "fit 1", "fit 2", "fit 3", "fit 2 / pyarrow", "RSS at step 1 (ranks, MB)",
              "kept on disk"]
    print(markdown(header, [[name, "off" if label == "before" else "on", *rest] for name, label, *rest in rows]))
    for label in ("before", "after"):
        if f"cv/{label}" in results:
            cv = results[f"cv/{label}"]
            print(f"CrossValidator 2 folds x 2 maps and its refit, keeping {'off' if label == 'before' else 'on'}: "
                  f"{cv['total_s']} s, {cv['jobs']} training jobs for 5 fits, {cv['fits_on_kept_rows']} of them on "
                  "kept rows, "
                  f"kept on disk after it {cv['kept_mb']} MB")


if __name__ == "__main__":
    main()
