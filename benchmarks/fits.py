"""One timed ``TorchEstimator`` fit, measured by its :class:`~benchmarks.hooks.ProbeHook`
(the contenders of this project share it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pyspark.sql import DataFrame

from spark_torch_est import TorchEstimator, TorchModel

from benchmarks.hooks import ProbeHook
from benchmarks.probes import read_rank_reports

__all__ = ["timed_fit", "touch_files", "noop_seconds"]


def timed_fit(estimator: TorchEstimator, df: DataFrame, ranks: int, probe: ProbeHook,
              duration: str | None = None) -> tuple[dict, TorchModel]:
    """Fits once; rank 0's report gives the first step, the loop rate and the tail.

    Returns the figures (``wall_s``, ``first_step_s``, the loop figures,
    ``after_run_to_return_s``, ``peak_rss_mb`` of every rank, ``checkpoint_mb`` and
    ``read``: ``"files"`` when the ranks read the Parquet themselves, else ``"spark"``)
    and the model.
    """
    called = time.time()
    model = estimator.fit(df, duration=duration)
    returned = time.time()
    reports = read_rank_reports(probe.directory, probe.tag, ranks)
    rank0 = reports[0]
    return {
        "wall_s": returned - called,
        "first_step_s": rank0.first_step - called,
        **rank0.loop_figures(),
        "after_run_to_return_s": returned - rank0.finished,
        "peak_rss_mb": [r.peak_rss_mb for r in reports],
        "checkpoint_mb": len(estimator.checkpoint.to_bytes()) / 1e6,
        "read": "spark" if estimator.checkpoint.data_source == "spark" else "files",
    }, model


def touch_files(path: str) -> None:
    """Gives every file under ``path`` a new modification time, so that the next fit's
    ranks read the Parquet again instead of training on the rows their Python workers kept
    from an earlier fit of the same files: the contenders compared with read every time."""
    for file in Path(path).rglob("*"):
        if file.is_file():
            os.utime(file)


def noop_seconds(frame: DataFrame) -> float:
    """Seconds to compute every row of ``frame`` into Spark's ``noop`` sink."""
    started = time.perf_counter()
    frame.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - started
