"""The plain training loop shared by the contenders without this project: plain torch,
bare DDP and TorchDistributor's train_fn. Pickled by value (see :mod:`benchmarks.remote`).

It does what ``spark_torch_est``'s loop does per step (seeded per-epoch shuffle, batches
of ``batch_size`` rows, the last one partial, the workload's loss,
zero_grad/forward/backward/step, the model called as ``model(*inputs)``, forward and loss
under ``torch.autocast`` when given a dtype) and nothing else.
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.probes import StepClock

__all__ = ["train"]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor,
          loss_fn: nn.Module, *, epochs: int, batch_size: int, seed: int, rank: int = 0,
          world_size: int = 1, autocast: torch.dtype | None = None) -> StepClock:
    """Trains ``model`` (a module or a DDP wrapper) in place; returns the step stamps.

    Every rank is assumed to hold as many rows as this one (the callers split evenly).
    ``autocast`` runs each forward and loss under ``torch.autocast`` with that dtype.
    """
    clock = StepClock()
    trained = 0
    model.train()
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 1_009 + rank)
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(labels), batch_size):
            rows = order[start:start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(labels.device.type, dtype=autocast, enabled=autocast is not None):
                loss = loss_fn(model(*[tensor[rows] for tensor in inputs]), labels[rows])
            loss.backward()
            optimizer.step()
            trained += len(rows) * world_size
            clock.step(trained)
    return clock
