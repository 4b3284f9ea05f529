"""[executor] Evening out the ranks' training rows before the first step.

Spark partitions are often uneven (Parquet row groups, filters, a skipped shuffle). DDP
needs every rank to take the same number of steps, and repeating a small partition's
rows to fill them would weight those rows more. So ranks with more than their share send
their last rows to ranks with less, point to point, once per fit: after it, row counts
differ by at most one. The plan is a pure function of the counts, so every rank computes
the same one, and each rank only sends or only receives, in plan order, which cannot
deadlock. Every column moves with its own dtype; arrays of different lengths move as
their lengths and their values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spark_torch_est.ingest.rows import DenseRows, RaggedRows, Rows, SpilledRows
from spark_torch_est.ingest.shard import Table

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


def rebalance(table: Table, plan: list[tuple[int, int, int]], rank: int, device: torch.device) -> Table:
    """Carries out ``plan`` for this rank; returns its new table.

    Every rank's table has the same columns with the same dtypes and row shapes (a rank
    without rows holds empty columns of those shapes).
    """
    columns = table.columns()
    outgoing = sum(rows for source, _, rows in plan if source == rank)
    keep = len(table) - outgoing
    start = keep
    for source, destination, rows in plan:
        if source == rank:
            for column in columns:
                _send(column, start, start + rows, destination, device)
            start += rows
        elif destination == rank:
            columns = [_receive(column, rows, source, device) for column in columns]
    if outgoing:
        columns = [column.head(keep) for column in columns]
    return table.with_columns(columns)


def _send(column: Rows, start: int, stop: int, destination: int, device: torch.device) -> None:
    if isinstance(column, RaggedRows):
        dist.send(column.lengths(start, stop).to(device), destination)
        dist.send(column.flat(start, stop).contiguous().to(device), destination)
    else:
        dist.send(column.slice(start, stop).contiguous().to(device), destination)


def _receive(column: Rows, rows: int, source: int, device: torch.device) -> Rows:
    if isinstance(column, RaggedRows):
        lengths = torch.empty(rows, dtype=torch.int64, device=device)
        dist.recv(lengths, source)
        values = torch.empty(int(lengths.sum()), dtype=column.dtype, device=device)
        dist.recv(values, source)
        return column.extend_flat(values.cpu(), lengths.cpu())
    received = torch.empty((rows, *column.row_shape), dtype=column.dtype, device=device)
    dist.recv(received, source)
    if isinstance(column, (DenseRows, SpilledRows)):
        return column.extend(received.cpu())
    raise TypeError(f"cannot receive rows into {type(column).__name__}")
