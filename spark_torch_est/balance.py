"""[executor] Evening out the ranks' training rows before the first step.

Spark partitions are often uneven (Parquet row groups, filters, a skipped shuffle). DDP
needs every rank to take the same number of steps, and repeating a small partition's
rows to fill them would weight those rows more. So ranks with more than their share send
their last rows to ranks with less, point to point, once per fit: after it, row counts
differ by at most one. The plan is a pure function of the counts, so every rank computes
the same one, and each rank only sends or only receives, in plan order, which cannot
deadlock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spark_torch_est.rowstore import SpilledRows

__all__ = ["transfer_plan", "rebalance"]


def transfer_plan(counts: list[int]) -> list[tuple[int, int, int]]:
    """``(source rank, destination rank, rows)`` moves that leave every rank with
    ``total // world`` or one more rows; the larger ranks keep the extra rows.

    >>> transfer_plan([2800, 200])
    [(0, 1, 1300)]
    >>> transfer_plan([5, 6])
    []
    """
    world = len(counts)
    share, extra = divmod(sum(counts), world)
    by_size = sorted(range(world), key=lambda r: (-counts[r], r))
    target = [share] * world
    for rank in by_size[:extra]:
        target[rank] += 1
    donors = [[r, counts[r] - target[r]] for r in range(world) if counts[r] > target[r]]
    takers = [[r, target[r] - counts[r]] for r in range(world) if counts[r] < target[r]]
    plan, d, t = [], 0, 0
    while d < len(donors) and t < len(takers):
        rows = min(donors[d][1], takers[t][1])
        plan.append((donors[d][0], takers[t][0], rows))
        donors[d][1] -= rows
        takers[t][1] -= rows
        d += donors[d][1] == 0
        t += takers[t][1] == 0
    return plan


def rebalance(features: torch.Tensor | SpilledRows, labels: torch.Tensor, plan: list[tuple[int, int, int]], rank: int,
              feature_shape: tuple[int, ...], label_shape: tuple[int, ...], label_dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor | SpilledRows, torch.Tensor]:
    """Carries out ``plan`` for this rank; returns its new features and labels.

    Args:
        features: This rank's ``(n, *feature_shape)`` rows.
        labels: Its ``(n, *label_shape)`` labels.
        plan: From :func:`transfer_plan`.
        rank: This rank.
        feature_shape: Shape of one feature row (the same on every rank).
        label_shape: Shape of one label.
        label_dtype: The labels' dtype.
        device: Where collectives need tensors (the rank's device for nccl).
    """
    outgoing = sum(rows for source, _, rows in plan if source == rank)
    keep = len(features) - outgoing
    start = keep
    received_x, received_y = [], []
    for source, destination, rows in plan:
        if source == rank:
            dist.send(features[start:start + rows].contiguous().to(device), destination)
            dist.send(labels[start:start + rows].contiguous().to(device), destination)
            start += rows
        elif destination == rank:
            x = torch.empty((rows, *feature_shape), dtype=torch.float32, device=device)
            y = torch.empty((rows, *label_shape), dtype=label_dtype, device=device)
            dist.recv(x, source)
            dist.recv(y, source)
            received_x.append(x.cpu())
            received_y.append(y.cpu())
    if outgoing:
        kept = features.head(keep) if isinstance(features, SpilledRows) else features[:keep].contiguous()
        return kept, labels[:keep].contiguous()
    if not received_x:
        return features, labels
    labels = torch.cat([labels.reshape(-1, *label_shape).to(label_dtype), *received_y])
    if isinstance(features, SpilledRows):  # spilled rows stay on disk: append to the file
        for rows in received_x:
            features.extend(rows)
        return features, labels
    return torch.cat([features.reshape(-1, *feature_shape), *received_x]), labels
