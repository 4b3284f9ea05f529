"""Contender: plain torch, one process using every core, no Spark and no DDP.

It trains on all rows with the global batch of the DDP contenders (``batch_size * ranks``
rows per step), so it takes the same number of steps as each rank does there.
"""

from __future__ import annotations

import os
import time

import torch

from benchmarks.loop import train
from benchmarks.probes import RankReport
from benchmarks.protocol import contender_main
from benchmarks.workload import Workload

__all__ = ["measure"]


def measure(workload: Workload, scratch: str, variant: str = "") -> dict:
    """Trains once; returns loop throughput and timings."""
    torch.set_num_threads(os.cpu_count() or 1)
    started = time.time()
    inputs, labels = workload.read_rank(0, 1)
    model, optimizer = workload.build()
    batch = workload.batch_size * workload.ranks
    clock = train(model, optimizer, inputs, labels, workload.loss_fn(), epochs=workload.epochs, batch_size=batch,
                  seed=workload.seed)
    report = RankReport.from_clock(0, clock)
    return {
        "wall_s": time.time() - started,
        "first_step_s": report.first_step - started,
        **report.loop_figures(),
        "threads": torch.get_num_threads(),
        "peak_rss_mb": [report.peak_rss_mb],
    }


if __name__ == "__main__":
    contender_main(measure)
