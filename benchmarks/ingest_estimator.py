"""Contender: this project on the ingest workload (:class:`~benchmarks.workload.IngestWorkload`):
how long ``fit()`` takes from the call to the first optimizer step, and a rank's memory.

One process, one fresh SparkSession, every fit a new estimator of ``steps`` optimizer
steps, in this order:

1. cold fit, direct read (the ranks read the Parquet with pyarrow, ``directRead=True``,
   the default): the session's first fit, in fresh Python workers, so its peak RSS is
   the whole life of the rank's process;
2. warm fit, direct read, after touching the files (a new modification time), so that
   the ranks read them again rather than reuse the rows their workers kept;
3. warm fit on the unchanged files: a worker that Spark gives the same part again trains
   on the rows it kept (which worker gets which task is up to Spark);
4. warm fit with ``directRead=False``: the same table through Spark (JVM scan, shuffle
   into ``numWorkers`` partitions, Arrow to the ranks);
5. two fits on ``df.cache()``: a cached DataFrame is not a plain scan, so both go through
   Spark; the first fills the cache, the second reads it;
6. ``transform`` of the whole table (the warm fit's model) into the ``noop`` sink, with the
   tasks reading the files and through Spark, alternately, twice each (the second of each
   is the figure: the first loads the model into the workers); then, once the session and
   its JVM have stopped, a plain batched forward over the same rows as numpy in this
   process with every core.

Variant ``scale`` (the growth table, :mod:`benchmarks.scale`) runs 1 to 3 only. A fit
that did not read the way its figure says fails the run. Right before each fit the
driver backs free memory (:mod:`benchmarks.memory`), as the pyarrow contender does before
its read.
"""

from __future__ import annotations


from pyspark.sql import DataFrame
from torch import nn

from spark_torch_est import TorchEstimator, TorchModel

from benchmarks.dataset import read_numpy
from benchmarks.fits import noop_seconds, timed_fit, touch_files
from benchmarks.forward import forward_rows_per_s
from benchmarks.hooks import ProbeHook
from benchmarks.memory import ingest_prefault_mb, prefault
from benchmarks.protocol import contender_main
from benchmarks.remote import register_by_value
from benchmarks.session import spark_session
from benchmarks.workload import IngestWorkload, make_model, make_optimizer

__all__ = ["measure"]


def measure(workload: IngestWorkload, scratch: str, variant: str = "") -> dict:
    """Runs the fits of the module docstring; returns one dict per fit."""
    register_by_value()
    with spark_session(workload, "bench-torchestimator-ingest") as (spark, start_s):
        df = spark.read.parquet(workload.path)
        result = {"session_start_s": start_s, "partitions": df.rdd.getNumPartitions()}

        def fit(name: str, frame: DataFrame, direct: bool, expect: str) -> TorchModel:
            probe = ProbeHook(scratch, f"ingest-{name}")
            prefault_s = prefault(ingest_prefault_mb(workload.rows, workload.features))
            result[name], model = timed_fit(_estimator(workload, probe, direct), frame, workload.ranks, probe,
                                        duration=f"{workload.steps}ba")
            result[name]["prefault_s"] = prefault_s
            if result[name]["read"] != expect:
                raise RuntimeError(f"the {name} fit read its rows through {result[name]['read']}, not {expect}")
            return model

        fit("cold", df, direct=True, expect="files")
        touch_files(workload.path)
        model = fit("warm", df, direct=True, expect="files")
        fit("reuse", df, direct=True, expect="files")
        if variant != "scale":
            fit("spark", df, direct=False, expect="spark")
            cached = df.cache()
            fit("cache_first", cached, direct=True, expect="spark")
            fit("cache_second", cached, direct=True, expect="spark")
            cached.unpersist(blocking=True)
            result["transform"] = _transform(model, df, workload)
    if "transform" in result:  # the JVM has exited: the forward has every core to itself
        features, _ = read_numpy(workload.path)
        result["transform"]["plain_forward_rows_per_s"] = forward_rows_per_s(model.torch_model(), features,
                                                                             model.getInferenceBatchSize())
    return result


def _transform(model: TorchModel, df: DataFrame, workload: IngestWorkload) -> dict:
    """Rows/s of ``transform`` reading the files and through Spark."""
    scorers = {"files": model, "spark": model.copy({model.directRead: False})}
    seconds = {}
    for name in ("files", "spark", "files", "spark"):
        scored = scorers[name].transform(df)
        if ("FileScan" in scored._jdf.queryExecution().executedPlan().toString()) != (name == "spark"):
            raise RuntimeError(f"the transform meant to read through {name} did not")
        seconds[name] = noop_seconds(scored)
    return {"files_rows_per_s": workload.rows / seconds["files"], "spark_rows_per_s": workload.rows / seconds["spark"]}


def _estimator(workload: IngestWorkload, probe: ProbeHook, direct: bool) -> TorchEstimator:
    return TorchEstimator(
        model=make_model, optimizer=make_optimizer, loss=nn.MSELoss(), config=workload.config, hooks=[probe],
        featuresCol="features", labelCol="label", batchSize=workload.batch_size, maxEpochs=workload.epochs,
        numWorkers=workload.ranks, seed=workload.seed, directRead=direct, showProgress=False,
    )


if __name__ == "__main__":
    contender_main(measure)
