"""Fit many, ingest once (issue 26): the first, second and third fit of a run to its first
optimizer step, with the rows kept between fits (``keepIngestedMB``, default) and without
(``keepIngestedMB=0``), side by side in one session, against pyarrow reading the same rows.

Three DataFrames over one Parquet file of ``rows x 32`` float32 (an ``array<float>``
features column and a float label): cached through Spark, uncached and computed (a filter
and a computed label), and the plain table (read by the ranks themselves). Then a
``CrossValidator`` of 2 folds x 2 param maps on the cached one, both ways. For each fit:
seconds from the call to rank 0's first step, each rank's RSS at its first step and its
process's peak RSS so far, and what the executors keep on disk after it.

Self-contained, public API only::

    python -m benchmarks.ingest_once            # 4M rows (about 520 MB of Parquet)
    python -m benchmarks.ingest_once --quick    # 200k rows
    python -m benchmarks.ingest_once --only plain,cv

The cached DataFrame is a cache of the table's own plan, so ``spark.read.parquet`` of that
path reads the cache while it lasts; the computed and plain scenarios read the same file
under another path (a hard link), which no cache covers.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import resource
import shutil
import tempfile
import time

import torch

from benchmarks.common import Workload, markdown, register_by_value, spark_session, write_data
from benchmarks.contenders import estimator, pyarrow
from spark_torch_est import Hook, TorchEstimator

#: One file of 1M-row row groups; an MLP 32-64-64-1, batches of 512, fits of one step.
WORKLOAD = Workload(rows=4_000_000, features=32, hidden=64, batch_size=512, epochs=1000, files=0)


class FirstStep(Hook):
    """Records, on rank 0, the wall time of the fit's first step and every rank's RSS then."""

    def __init__(self) -> None:
        self.at = 0.0
        self.rss_mb: list[float] = []
        self.peak_mb: list[float] = []

    def before_run(self) -> None:
        self.at, self.rss_mb, self.peak_mb = 0.0, [], []

    def before_train_iter(self, world_size: int) -> None:
        if self.at:
            return
        self.at = time.time()
        with open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        mine = torch.tensor([rss, peak], dtype=torch.float64)
        if world_size > 1:
            import torch.distributed as dist

            gathered = [torch.zeros_like(mine) for _ in range(world_size)]
            dist.all_gather(gathered, mine)
        else:
            gathered = [mine]
        self.rss_mb = [round(float(g[0])) for g in gathered]
        self.peak_mb = [round(float(g[1])) for g in gathered]

    def state_dict(self) -> dict:
        return {"at": self.at, "rss_mb": self.rss_mb, "peak_mb": self.peak_mb}

    def load_state_dict(self, state: dict) -> None:
        self.at, self.rss_mb, self.peak_mb = state["at"], list(state["rss_mb"]), list(state["peak_mb"])


def kept_on_disk(local_dir: str) -> int:
    """Bytes the executors keep under the session's local directory."""
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(local_dir, "*", "spark_torch_est-kept", "*", "*")))


def _estimator(probe: FirstStep, keep_mb: float) -> TorchEstimator:
    return estimator(WORKLOAD, {"probe": probe}, keepIngestedMB=keep_mb)


def three_fits(df, keep_mb: float, local_dir: str) -> list[dict]:
    """The first three fits of one run (one step each) on ``df``."""
    probe = FirstStep()
    est = _estimator(probe, keep_mb)
    fits = []
    for _ in range(3):
        called = time.time()
        est.fit(df, duration="1ba")
        state = est.hooks["probe"]
        fits.append({"first_step_s": round(state.at - called, 2), "done_s": round(time.time() - called, 2),
                     "rss_mb": state.rss_mb, "peak_mb": state.peak_mb,
                     "kept_mb": round(kept_on_disk(local_dir) / 2 ** 20)})
    return fits


def cross_validation(df, keep_mb: float, local_dir: str) -> dict:
    """A CrossValidator of 2 folds x 2 maps (one epoch per fit), then its refit."""
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    probe = FirstStep()
    est = _estimator(probe, keep_mb).setMaxEpochs(1)  # each fit trains one epoch of its fold
    configs = [WORKLOAD.config, {**WORKLOAD.config, "lr": 0.001}]
    grid = ParamGridBuilder().addGrid(est.getParam("config"), configs).build()
    reused = _Count("kept this DataFrame's rows")  # the driver's log line of a fit on kept rows
    log = logging.getLogger("spark_torch_est.ingest.kept_registry")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(reused)
    started = time.time()
    try:
        CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=0, parallelism=1,
                       evaluator=RegressionEvaluator(labelCol="label", predictionCol="prediction")).fit(df)
    finally:
        log.removeHandler(reused)
        log.setLevel(level)
    return {"total_s": round(time.time() - started, 1), "fits_on_kept_rows": reused.count,
            "kept_mb": round(kept_on_disk(local_dir) / 2 ** 20)}


class _Count(logging.Handler):
    """Counts the log records that contain ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.INFO)
        self.text, self.count = text, 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += self.text in record.getMessage()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200k rows instead of 4M")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--only", default="cached,computed,plain,cv",
                        help="comma-separated scenarios among cached, computed, plain, cv (default: all)")
    args = parser.parse_args()
    rows = args.rows or (200_000 if args.quick else 4_000_000)

    scratch = tempfile.mkdtemp(prefix="ingest_once-")
    try:
        _run(rows, args.only.split(","), scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(rows: int, only: list[str], scratch: str) -> None:
    register_by_value()
    local_dir = os.path.join(scratch, "local")
    workload = write_data(dataclasses.replace(WORKLOAD, rows=rows), scratch)
    # 4 GB: the 4M-row cache (about 520 MB) and a fold's caches besides it; under the default
    # 1 GB the CrossValidator's shuffles thrash for many minutes.
    with spark_session(2, "bench-ingest-once", **{"spark.driver.memory": "4g", "spark.local.dir": local_dir}) as spark:
        results = _scenarios(spark, workload, only, scratch, local_dir)
    print(json.dumps(results, indent=1))
    _table(results)


def _scenarios(spark, workload: Workload, only: list[str], scratch: str, local_dir: str) -> dict:
    from pyspark.sql import functions as F

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
    frames = {
        "cached": cached,
        "computed": spark.read.parquet(plain).filter(F.col("label") > -1e30).withColumn("label", F.col("label") * 2),
        "plain": spark.read.parquet(plain),
    }
    _estimator(FirstStep(), 0).fit(spark.read.parquet(table).limit(1000), duration="1ba")  # warm the Python workers
    for name, df in frames.items():
        if name not in only:
            continue
        results["pyarrow_s"].append(round(pyarrow(workload, scratch)["read_s"], 2))
        for label, keep_mb in (("before", 0.0), ("after", 8192.0)):
            results[f"{name}/{label}"] = three_fits(df, keep_mb, local_dir)
            print(json.dumps({f"{name}/{label}": results[f"{name}/{label}"]}), flush=True)
    if "cv" in only:
        for label, keep_mb in (("before", 0.0), ("after", 8192.0)):
            results[f"cv/{label}"] = cross_validation(cached, keep_mb, local_dir)
            print(json.dumps({f"cv/{label}": results[f"cv/{label}"]}), flush=True)
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
                  f"{cv['total_s']} s, {cv['fits_on_kept_rows']} of 5 fits on kept rows, "
                  f"kept on disk after it {cv['kept_mb']} MB")


if __name__ == "__main__":
    main()
