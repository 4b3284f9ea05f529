"""Contender: this project, ``TorchEstimator(...).fit(df)`` on ``spark.read.parquet``.

One process, one fresh SparkSession, in this order (before every fit after the first the
files get a new modification time, :func:`~benchmarks.fits.touch_files`: each fit reads
them, as the peers do):

1. cold fit: the session's first fit;
2. warm fit: a new estimator, the same epochs (``featuresCol="features"``);
3. typed inputs: two warm fits with ``inputCols=["features"]`` (the model gets the same
   one float32 tensor, through the typed path), then one more with ``featuresCol``: with
   the warm fit of 2, the order A B B A, so drift of the machine hits both alike;
4. warm fit without hooks, timed from the driver's progress records only
   (:mod:`benchmarks.listener`): what the probe hook itself costs;
5. resumed fit: the warm estimator of 2 again, ``maxEpochs + 1`` and ``duration="1ep"``;
6. ``TorchModel.transform`` of every row into the ``noop`` sink, twice, then the scan alone
   and a ``mapInArrow`` identity into the same sink (the floor of any transform through
   Spark), and the plain batched forward of the same module over the same rows;
7. two short fits, of the MLP and of the MLP with ~100 MB of frozen parameters, whose
   difference prices the checkpoint's way back to the driver.

Every fit but the one of 4 carries a :class:`~benchmarks.hooks.ProbeHook`.
"""

from __future__ import annotations

import sys
import time
from typing import Iterator

import pyarrow as pa

from pyspark.sql import DataFrame
from torch import nn

from spark_torch_est import TorchEstimator, TorchModel

from benchmarks.dataset import read_numpy
from benchmarks.fits import noop_seconds, timed_fit, touch_files
from benchmarks.forward import forward_rows_per_s
from benchmarks.hooks import ProbeHook
from benchmarks.listener import ProgressRecords
from benchmarks.protocol import contender_main
from benchmarks.remote import register_by_value
from benchmarks.session import spark_session
from benchmarks.workload import Workload, make_big_model, make_model, make_optimizer

__all__ = ["measure"]


def measure(workload: Workload, scratch: str, variant: str = "") -> dict:
    """Runs the sequence in the module docstring; returns one dict per measurement."""
    register_by_value(sys.modules[__name__])  # _identity runs in the executors
    with spark_session(workload, "bench-torchestimator") as (spark, start_s):
        df = spark.read.parquet(workload.path)
        probe = ProbeHook(scratch, "te-cold")
        cold, _ = timed_fit(_estimator(workload, probe), df, workload.ranks, probe)
        touch_files(workload.path)
        probe = ProbeHook(scratch, "te-warm")
        estimator = _estimator(workload, probe)
        warm, model = timed_fit(estimator, df, workload.ranks, probe)
        typed = _typed_inputs(df, workload, scratch)
        no_hook = _fit_without_hooks(df, workload)
        estimator.setMaxEpochs(workload.epochs + 1)
        touch_files(workload.path)
        probe.tag = "te-resume"
        resume, _ = timed_fit(estimator, df, workload.ranks, probe, duration="1ep")
        transform = _transform(model, df, workload)
        checkpoint = _checkpoint_transfer(df, workload, scratch)
    return {"session_start_s": start_s, "cold": cold, "warm": warm, "typed": typed, "warm_no_hook": no_hook,
            "resume": resume, "transform": transform, "checkpoint": checkpoint}


def _estimator(workload: Workload, probe: ProbeHook | None, model=make_model,
               max_epochs: int | None = None, typed: bool = False) -> TorchEstimator:
    """The reference estimator; ``typed`` names the features column in ``inputCols`` instead."""
    return TorchEstimator(
        model=model, optimizer=make_optimizer, loss=nn.MSELoss(), config=workload.config,
        hooks=[probe] if probe is not None else None, featuresCol="features",
        inputCols=["features"] if typed else None, labelCol="label",
        batchSize=workload.batch_size, maxEpochs=max_epochs or workload.epochs, numWorkers=workload.ranks,
        seed=workload.seed, showProgress=False,
    )


def _typed_inputs(df: DataFrame, workload: Workload, scratch: str) -> dict[str, list[dict]]:
    """After the warm fit (A): two warm fits with ``inputCols=["features"]`` (B B), then one
    more with ``featuresCol`` (A). Returns ``{"inputs": [B, B], "features": [A]}``."""
    fits: dict[str, list[dict]] = {"inputs": [], "features": []}
    for number, typed in enumerate((True, True, False)):
        touch_files(workload.path)
        probe = ProbeHook(scratch, f"te-typed-{number}")
        fits["inputs" if typed else "features"].append(
            timed_fit(_estimator(workload, probe, typed=typed), df, workload.ranks, probe)[0])
    return fits


def _fit_without_hooks(df: DataFrame, workload: Workload) -> dict:
    """A warm fit with no hook, followed through the driver's progress records."""
    touch_files(workload.path)
    with ProgressRecords() as records:
        called = time.time()
        _estimator(workload, None).fit(df)
        wall = time.time() - called
    return {"wall_s": wall, **records.loop_figures(called)}


def _transform(model: TorchModel, df: DataFrame, workload: Workload) -> dict:
    """``transform`` into the noop sink twice, then what any transform through Spark costs
    at least (the scan alone, and a ``mapInArrow`` that returns its input), then the plain
    forward baseline."""
    seconds = [noop_seconds(model.transform(df)) for _ in range(2)]
    scan = noop_seconds(df)
    identity = noop_seconds(df.mapInArrow(_identity, df.schema))
    features, _ = read_numpy(workload.path)
    return {
        "rows_per_s": workload.rows / seconds[0],
        "repeat_rows_per_s": workload.rows / seconds[1],
        "scan_rows_per_s": workload.rows / scan,
        "identity_rows_per_s": workload.rows / identity,
        "plain_forward_rows_per_s": forward_rows_per_s(model.torch_model(), features, model.getInferenceBatchSize()),
    }


def _identity(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A mapInArrow function that returns its input: the Python round trip alone."""
    yield from batches


def _checkpoint_transfer(df: DataFrame, workload: Workload, scratch: str) -> dict:
    """A short fit of the MLP and of the MLP with frozen ballast; same steps, same data."""
    duration = f"{workload.checkpoint_steps}ba"
    fits = {}
    for name, creator in (("small", make_model), ("big", make_big_model)):
        touch_files(workload.path)
        probe = ProbeHook(scratch, f"te-ckpt-{name}")
        estimator = _estimator(workload, probe, model=creator, max_epochs=1)
        fits[name], _ = timed_fit(estimator, df, workload.ranks, probe, duration=duration)
    return fits


if __name__ == "__main__":
    contender_main(measure)
