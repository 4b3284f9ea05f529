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
import glob
import json
import logging
import os
import resource
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from spark_torch_est import Hook, TorchEstimator

FEATURES = 32


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


def _model(config: dict) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def _optimizer(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.01))


def write_table(path: str, rows: int, seed: int = 0) -> str:
    """One Parquet file of ``rows`` rows in row groups of 1M rows; returns its folder."""
    os.makedirs(path)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(FEATURES, dtype=np.float32) / np.sqrt(FEATURES)
    schema = pa.schema([("features", pa.list_(pa.float32())), ("label", pa.float32())])
    with pq.ParquetWriter(os.path.join(path, "part-0.parquet"), schema) as writer:
        for start in range(0, rows, 1_000_000):
            n = min(1_000_000, rows - start)
            x = rng.standard_normal((n, FEATURES), dtype=np.float32)
            y = x @ w
            features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), FEATURES).cast(schema[0].type)
            writer.write_table(pa.table([features, pa.array(y)], schema=schema), row_group_size=n)
    return path


def pyarrow_read(path: str) -> float:
    """Seconds for pyarrow to read the table into numpy (features matrix and labels)."""
    started = time.perf_counter()
    table = pq.read_table(path)
    features = table.column("features").combine_chunks()
    matrix = features.flatten().to_numpy().reshape(len(features), -1)
    labels = table.column("label").to_numpy()
    assert matrix.shape[1] == FEATURES and len(labels) == len(matrix)
    return time.perf_counter() - started


def kept_on_disk(local_dir: str) -> int:
    """Bytes the executors keep under the session's local directory."""
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(local_dir, "*", "spark_torch_est-kept", "*", "*")))


def _estimator(probe: FirstStep, keep_mb: float, **params) -> TorchEstimator:
    return TorchEstimator(model=_model, optimizer=_optimizer, loss=torch.nn.MSELoss(), hooks={"probe": probe},
                          featuresCol="features", labelCol="label", batchSize=512, maxEpochs=1000, numWorkers=2,
                          showProgress=False, keepIngestedMB=keep_mb, **params)


def three_fits(df, keep_mb: float, local_dir: str) -> list[dict]:
    """The first three fits of one run (one step each) on ``df``."""
    probe = FirstStep()
    estimator = _estimator(probe, keep_mb)
    fits = []
    for _ in range(3):
        called = time.time()
        estimator.fit(df, duration="1ba")
        state = estimator.hooks["probe"]
        fits.append({"first_step_s": round(state.at - called, 2), "done_s": round(time.time() - called, 2),
                     "rss_mb": state.rss_mb, "peak_mb": state.peak_mb,
                     "kept_mb": round(kept_on_disk(local_dir) / 2 ** 20)})
    return fits


def cross_validation(df, keep_mb: float, local_dir: str) -> dict:
    """A CrossValidator of 2 folds x 2 maps (one epoch per fit), then its refit."""
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    probe = FirstStep()
    estimator = _estimator(probe, keep_mb).setMaxEpochs(1)  # each fit trains one epoch of its fold
    grid = ParamGridBuilder().addGrid(estimator.getParam("config"), [{"lr": 0.01}, {"lr": 0.001}]).build()
    reused = _Count("kept this DataFrame's rows")  # the driver's log line of a fit on kept rows
    log = logging.getLogger("spark_torch_est.ingest.kept_registry")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(reused)
    started = time.time()
    try:
        CrossValidator(estimator=estimator, estimatorParamMaps=grid, numFolds=2, seed=0, parallelism=1,
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
    from pyspark.sql import SparkSession

    local_dir = os.path.join(scratch, "local")
    table = write_table(os.path.join(scratch, "table"), rows)
    # 4 GB: the 4M-row cache (about 520 MB) and a fold's caches besides it; under the default
    # 1 GB the CrossValidator's shuffles thrash for many minutes.
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "4g").config("spark.local.dir", local_dir)
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        results = _scenarios(spark, rows, only, scratch, table, local_dir)
    finally:
        spark.stop()
    print(json.dumps(results, indent=1))
    _table(results)


def _scenarios(spark, rows: int, only: list[str], scratch: str, table: str, local_dir: str) -> dict:
    from pyspark.sql import functions as F

    results: dict = {"rows": rows, "load_average": os.getloadavg()[0], "pyarrow_s": []}
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
        results["pyarrow_s"].append(round(pyarrow_read(table), 2))
        for label, keep_mb in (("before", 0.0), ("after", 8192.0)):
            results[f"{name}/{label}"] = three_fits(df, keep_mb, local_dir)
            print(json.dumps({f"{name}/{label}": results[f"{name}/{label}"]}), flush=True)
    if "cv" in only:
        for label, keep_mb in (("before", 0.0), ("after", 8192.0)):
            results[f"cv/{label}"] = cross_validation(cached, keep_mb, local_dir)
            print(json.dumps({f"cv/{label}": results[f"cv/{label}"]}), flush=True)
    results["pyarrow_s"].append(round(pyarrow_read(table), 2))
    return results


def _table(results: dict) -> None:
    pyarrow = min(results["pyarrow_s"])
    print(f"\n{results['rows']:,} rows x {FEATURES} float32, local[2], load average {results['load_average']:.1f}; "
          f"pyarrow reads the table in {pyarrow:.2f} s (best of {len(results['pyarrow_s'])})")
    print("| DataFrame | keeping | fit 1 | fit 2 | fit 3 | fit 2 / pyarrow | RSS at step 1 (ranks, MB) "
          "| kept on disk |")
    print("|---|---|---|---|---|---|---|---|")
    for key, fits in results.items():
        if "/" not in key or key.startswith("cv/"):
            continue
        name, label = key.split("/")
        steps = [f"{fit['first_step_s']:.2f} s" for fit in fits]
        print(f"| {name} | {'off' if label == 'before' else 'on'} | {' | '.join(steps)} | "
              f"{fits[1]['first_step_s'] / pyarrow:.1f}x | {fits[1]['rss_mb']} (peak {fits[1]['peak_mb']}) | "
              f"{fits[-1]['kept_mb']} MB |")
    for label in ("before", "after"):
        if f"cv/{label}" in results:
            cv = results[f"cv/{label}"]
            print(f"CrossValidator 2 folds x 2 maps and its refit, keeping {'off' if label == 'before' else 'on'}: "
                  f"{cv['total_s']} s, {cv['fits_on_kept_rows']} of 5 fits on kept rows, "
                  f"kept on disk after it {cv['kept_mb']} MB")


if __name__ == "__main__":
    main()
