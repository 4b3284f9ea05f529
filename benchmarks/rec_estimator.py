"""Contender: this project on the recommender workload (:mod:`benchmarks.recommender`):
``TorchEstimator(inputCols=["user", "item", "dense"])`` on ``spark.read.parquet``.

One process, one fresh SparkSession: a short fit (``warmup_steps`` steps) warms the session
up, then a new estimator trains the workload's epochs; the loop figures come from that
warm fit, to set beside bare DDP (:mod:`benchmarks.ddp`) on the same tensors.
"""

from __future__ import annotations

from spark_torch_est import TorchEstimator

from benchmarks.fits import timed_fit, touch_files
from benchmarks.hooks import ProbeHook
from benchmarks.protocol import contender_main
from benchmarks.recommender import INPUT_COLS, LABEL_COL, RecWorkload, make_rec_model
from benchmarks.remote import register_by_value
from benchmarks.session import spark_session
from benchmarks.workload import make_optimizer

__all__ = ["measure"]


def measure(workload: RecWorkload, scratch: str, variant: str = "") -> dict:
    """A warm-up fit and the timed warm fit in one fresh session."""
    register_by_value()
    with spark_session(workload, "bench-torchestimator-recommender") as (spark, start_s):
        df = spark.read.parquet(workload.path)
        probe = ProbeHook(scratch, "rec-cold")
        cold, _ = timed_fit(_estimator(workload, probe), df, workload.ranks, probe,
                            duration=f"{workload.warmup_steps}ba")
        touch_files(workload.path)
        probe = ProbeHook(scratch, "rec-warm")
        warm, _ = timed_fit(_estimator(workload, probe), df, workload.ranks, probe)
    return {"session_start_s": start_s, "cold": cold, "warm": warm}


def _estimator(workload: RecWorkload, probe: ProbeHook) -> TorchEstimator:
    return TorchEstimator(
        model=make_rec_model, optimizer=make_optimizer, loss=workload.loss_fn(), config=workload.config,
        hooks=[probe], inputCols=INPUT_COLS, labelCol=LABEL_COL, batchSize=workload.batch_size,
        maxEpochs=workload.epochs, numWorkers=workload.ranks, seed=workload.seed, showProgress=False,
    )


if __name__ == "__main__":
    contender_main(measure)
