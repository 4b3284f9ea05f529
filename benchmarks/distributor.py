"""Contender: ``pyspark.ml.torch.distributor.TorchDistributor`` running a train_fn that
reads the Parquet with pyarrow and trains DDP with the same loop as bare DDP.

One process, one fresh SparkSession: the first ``run()`` is the cold call, the second
(a new distributor, same session) the warm one. Variants: ``local`` (``local_mode=True``:
torchrun on the driver, no Spark job) and ``barrier`` (``local_mode=False``: one barrier
task per rank, each starting torchrun with one process).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from pyspark.ml.torch.distributor import TorchDistributor

from benchmarks.ddp_rank import finish_rank, train_rank
from benchmarks.probes import read_rank_reports
from benchmarks.protocol import contender_main
from benchmarks.remote import register_by_value
from benchmarks.session import spark_session
from benchmarks.workload import Workload

__all__ = ["measure", "train_fn"]

VARIANTS = {"local": True, "barrier": False}


def train_fn(workload_json: str, scratch: str, tag: str) -> dict:
    """Runs in every torchrun worker (pickled by value, as this module is registered);
    returns the trained weights."""
    workload = Workload.from_json(workload_json)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    inputs, labels = workload.read_rank(rank, world_size)
    dist.init_process_group("gloo")
    weights = train_rank(workload, rank, world_size, inputs, labels, scratch, tag)
    finish_rank()
    return weights


def measure(workload: Workload, scratch: str, variant: str = "local") -> dict:
    """A cold and a warm ``run()`` in one fresh session."""
    register_by_value(sys.modules[__name__])
    with spark_session(workload, f"bench-torchdistributor-{variant}") as (spark, start_s):
        cold = _run(workload, scratch, variant, "td-cold")
        warm = _run(workload, scratch, variant, "td-warm")
    return {"session_start_s": start_s, "cold": cold, "warm": warm}


def _run(workload: Workload, scratch: str, variant: str, tag: str) -> dict:
    called = time.time()
    distributor = TorchDistributor(num_processes=workload.ranks, local_mode=VARIANTS[variant], use_gpu=False)
    weights = distributor.run(train_fn, workload.to_json(), scratch, tag)
    wall = time.time() - called
    if not weights:
        raise RuntimeError("TorchDistributor returned no weights")
    reports = read_rank_reports(scratch, tag, workload.ranks)
    return {
        "wall_s": wall,
        "first_step_s": reports[0].first_step - called,
        **reports[0].loop_figures(),
        "peak_rss_mb": [r.peak_rss_mb for r in reports],
    }


if __name__ == "__main__":
    contender_main(measure)
