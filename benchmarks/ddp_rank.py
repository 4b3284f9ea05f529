"""One DDP rank of the plain contenders (bare DDP, TorchDistributor's train_fn), between
``init_process_group`` and its teardown. Pickled by value (see :mod:`benchmarks.remote`).

The callers read their shard before the rendezvous, as ``spark_torch_est`` does, and
tear down in the order that cannot hang (docs/reliability.md): no DDP module outlives
:func:`train_rank`, then :func:`finish_rank`.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.loop import train
from benchmarks.probes import RankReport, write_rank_report
from benchmarks.workload import WorkloadBase

__all__ = ["train_rank", "finish_rank"]


def train_rank(workload: WorkloadBase, rank: int, world_size: int, inputs: tuple[torch.Tensor, ...],
               labels: torch.Tensor, scratch: str, tag: str) -> dict[str, torch.Tensor]:
    """Trains this rank, writes its report; returns the trained weights.

    Every rank returns them (DDP keeps the replicas equal): with ``local_mode=True``,
    TorchDistributor hands back the output of whichever rank writes its output file last,
    not necessarily rank 0's.
    """
    model, optimizer = workload.build()
    ddp_model = DistributedDataParallel(model)
    clock = train(ddp_model, optimizer, inputs, labels, workload.loss_fn(), epochs=workload.epochs,
                  batch_size=workload.batch_size, seed=workload.seed, rank=rank, world_size=world_size)
    write_rank_report(scratch, tag, RankReport.from_clock(rank, clock))
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def finish_rank() -> None:
    """Waits for every rank, then destroys the process group."""
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
