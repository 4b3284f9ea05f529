"""Contender: bare DDP without Spark: ``ranks`` processes from ``torch.multiprocessing.spawn``,
gloo on loopback, one thread each, the same loop as the other plain contenders, on the
tensors of whichever workload it is given (the reference MLP or the recommender).

Rank 0 also times a tiny all-reduce (two int32, like ``spark_torch_est``'s per-step stop
flags) after training, to price one extra collective per step.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.ddp_rank import finish_rank, train_rank
from benchmarks.probes import read_rank_reports
from benchmarks.protocol import contender_main
from benchmarks.workload import WorkloadBase

__all__ = ["measure"]

_TAG = "ddp"
_FLAG_REDUCES = 500


def measure(workload: WorkloadBase, scratch: str, variant: str = "") -> dict:
    """Spawns the ranks, trains once; returns timings from rank 0's report."""
    port = _free_port()
    called = time.time()
    mp.spawn(_rank_main, args=(workload, scratch, port), nprocs=workload.ranks, join=True)
    wall = time.time() - called
    reports = read_rank_reports(scratch, _TAG, workload.ranks)
    with open(os.path.join(scratch, "flag-allreduce.json")) as handle:
        flag_us = json.load(handle)["us"]
    return {
        "wall_s": wall,
        "first_step_s": reports[0].first_step - called,
        **reports[0].loop_figures(),
        "flag_allreduce_us": flag_us,
        "peak_rss_mb": [r.peak_rss_mb for r in reports],
    }


def _rank_main(rank: int, workload: WorkloadBase, scratch: str, port: int) -> None:
    torch.set_num_threads(1)
    inputs, labels = workload.read_rank(rank, workload.ranks)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=workload.ranks, timeout=timedelta(seconds=120))
    train_rank(workload, rank, workload.ranks, inputs, labels, scratch, _TAG)
    flag_us = _time_flag_allreduce()
    if rank == 0:
        with open(os.path.join(scratch, "flag-allreduce.json"), "w") as handle:
            json.dump({"us": flag_us}, handle)
    finish_rank()


def _time_flag_allreduce() -> float:
    """Microseconds per all-reduce of two int32 (MAX), after a warm-up."""
    flags = torch.zeros(2, dtype=torch.int32)
    for _ in range(20):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    started = time.perf_counter()
    for _ in range(_FLAG_REDUCES):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return (time.perf_counter() - started) / _FLAG_REDUCES * 1e6


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    contender_main(measure)
