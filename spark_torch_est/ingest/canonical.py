"""[executor] One epoch order on any number of ranks: logical shards fixed by the run.

A run fixes ``shards`` (L) when it starts: its first world size, kept in its checkpoints.
Every row has a place in that layout that does not depend on how Spark dealt the rows
out: the ranks hash each training row's bytes (every column, :func:`row_keys`), gather the
hashes once per launch, and sort them; the row with the ``g``-th smallest hash is row
``g`` of the run, in logical shard ``g % L`` at position ``g // L``. Identical rows hash
alike and are interchangeable. An epoch's order is then a function of ``(seed, epoch)``
and the rows only: shard ``j`` visits its rows in ``epoch_order(rows of j, seed, epoch,
j)``, and global step ``s`` trains positions ``s * b`` onwards of every shard's order
(``b``: rows per shard per step, the global batch over L).

On L ranks (the usual case) rank ``r`` holds shard ``r`` and trains its part of each
step, exactly the loop of a fixed world size: no exchange after the one at the launch.
On W != L ranks (a shrink, a grow, a later fit with another ``numWorkers``) the rows of
each step are cut into W runs of near-equal length, rank ``w`` training the ``w``-th; at
the start of each epoch the ranks exchange (point to point, tensors only) the rows each
needs for it, so every rank holds about ``1/W`` of the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from spark_torch_est.core.ranks import Ranks
from spark_torch_est.ingest.rows import Budget, DenseRows, RaggedRows, Rows, RowsBuilder, SpilledRows
from spark_torch_est.ingest.shard import EpochPlan, Table, epoch_order

__all__ = ["row_keys", "CanonicalRows", "EpochRows", "to_canonical"]

_CHUNK_VALUES = 1 << 20  # values hashed or copied at once (8 MB of temporaries each)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, in place on uint64 values (wrapping arithmetic)."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def _bits(values: torch.Tensor) -> np.ndarray:
    """Each value's bit pattern as uint64, whatever its dtype."""
    values = values.contiguous()
    size = values.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    if values.dtype == torch.bool:
        values = values.to(torch.uint8)
    return values.view(as_int).to(torch.int64).numpy().view(np.uint64)


def _hash_elements(elements: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """One key per row from its values (``elements`` of all rows, one after the other,
    ``lengths`` values each): the same values give the same key however they are held."""
    starts = np.cumsum(lengths) - lengths
    position = np.arange(len(elements), dtype=np.uint64) - np.repeat(starts, lengths).astype(np.uint64)
    mixed = _mix(elements + position * _GOLDEN + np.uint64(1))
    sums = np.zeros(len(lengths), dtype=np.uint64)
    filled = lengths > 0
    if filled.any():
        sums[filled] = np.add.reduceat(mixed, starts[filled])
    return _mix(sums + lengths.astype(np.uint64) * _M2)


def _hash_rows(elements: np.ndarray) -> np.ndarray:
    """:func:`_hash_elements` of rows of one length, ``elements`` ``(rows, length)``."""
    width = elements.shape[1]
    mixed = _mix(elements + (np.arange(width, dtype=np.uint64) * _GOLDEN + np.uint64(1)))
    return _mix(mixed.sum(axis=1, dtype=np.uint64) + np.uint64(width * int(_M2) % (1 << 64)))


def _column_keys(rows: Rows, by_value: bool = False) -> np.ndarray:
    """A key per row of one column, read in chunks (spilled rows stay on disk); ``by_value``:
    of the values as float64, so that 3 and 3.0 hash alike."""
    count, keys = len(rows), []

    def bits(values: torch.Tensor) -> np.ndarray:
        return _bits(values.to(torch.float64) if by_value else values)

    if isinstance(rows, RaggedRows):
        lengths = rows.lengths().numpy()
        step = max(1, _CHUNK_VALUES // max(1, int(lengths.mean()) if count else 1))
        for start in range(0, count, step):
            stop = min(start + step, count)
            keys.append(_hash_elements(bits(rows.flat(start, stop)).reshape(-1), lengths[start:stop]))
    else:
        width = math.prod(rows.row_shape)
        step = max(1, _CHUNK_VALUES // max(width, 1))
        for start in range(0, count, step):
            stop = min(start + step, count)
            keys.append(_hash_rows(bits(rows.slice(start, stop)).reshape(stop - start, width)))
    return np.concatenate(keys) if keys else np.zeros(0, dtype=np.uint64)


def row_keys(table: Table) -> torch.Tensor:
    """A 64-bit hash of every row's values in every column (int64), independent of where
    the row sits or how its columns are held. Labels hash by value: a column of whole numbers
    holds them as int64 or float32 as Spark typed it, and both train alike."""
    keys = np.zeros(len(table), dtype=np.uint64)
    for rows in table.columns():
        keys = _mix(keys * _GOLDEN + _column_keys(rows, by_value=rows is table.labels))
    return torch.from_numpy(keys.view(np.int64))


@dataclass
class EpochRows:
    """The rows one rank trains in (the rest of) one epoch.

    Attributes:
        table: The rows this rank holds for the epoch.
        plan: The steps of every logical shard (see :class:`EpochPlan`), from the epoch's offset.
        steps: Optimizer steps left in the epoch.
    """

    table: Table
    plan: EpochPlan
    steps: int
    _order: torch.Tensor | None = None
    _bounds: torch.Tensor | None = None

    def take(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """This rank's rows of ``step`` (counted from the plan's start): ``(inputs, labels, weights)``."""
        if self._order is not None:
            return self.table.take(self.plan.positions(self._order, step))
        bounds = self._bounds
        if bounds is None:
            raise ValueError("EpochRows needs the rank's order or the bounds of its steps")
        return self.table.slice(int(bounds[step]), int(bounds[step + 1]))

    def samples(self, step: int) -> int:
        """Rows all ranks together train on at ``step``."""
        return self.plan.samples(step)


class CanonicalRows:
    """A rank's training rows in the run's logical shards, and each epoch's rows of the rank.

    Args:
        table: The rows this rank holds: after :func:`to_canonical`, those of ids
            ``rank, rank + W, ...`` in that order.
        total: Training rows of all ranks.
        shards: The run's logical shards (L).
        shard_batch: Rows of each shard per global step.
        seed: The run's seed.
        ranks: This rank and the world.
        budget: Bytes of input rows kept in RAM before they spill (None: never).
    """

    def __init__(self, table: Table, total: int, shards: int, shard_batch: int, seed: int, ranks: Ranks,
                 budget: int | None = None) -> None:
        self.table, self.total, self.shards, self.shard_batch = table, total, shards, shard_batch
        self.seed, self.ranks, self.budget = seed, ranks, budget
        self.held = torch.arange(ranks.rank, total, ranks.world_size)
        self.holders: torch.Tensor | None = None  # which rank holds each row; made on W != L ranks only

    @property
    def shard_rows(self) -> list[int]:
        """Rows of each logical shard."""
        return [len(range(j, self.total, self.shards)) for j in range(self.shards)]

    def epoch(self, epoch: int, offset: int) -> EpochRows:
        """Collective on W != L ranks: the rows this rank trains in ``epoch`` from ``offset``
        rows of each shard's order on, exchanged with the other ranks first."""
        plan = EpochPlan(self.shard_rows, self.shard_batch, offset)
        if self.ranks.world_size == self.shards:
            order = epoch_order(len(self.table), self.seed, epoch, self.ranks.rank)
            return EpochRows(self.table, plan, plan.steps, _order=order)
        pieces, done = self._pieces(plan, epoch)
        world, wanted = self.ranks.world_size, []
        for w in range(world):
            wanted.append(torch.cat([*(step[w] for step in pieces), done[done % world == w]]))
        holders = self.holders if self.holders is not None else torch.arange(self.total) % world
        self.table = regroup(self.table, self.held, holders, wanted, self.ranks, self.budget)
        self.held = wanted[self.ranks.rank]
        for w in range(world):
            holders[wanted[w]] = w
        self.holders = holders
        lengths = torch.tensor([len(step[self.ranks.rank]) for step in pieces], dtype=torch.int64)
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        return EpochRows(self.table, plan, plan.steps, _bounds=bounds)

    def _pieces(self, plan: EpochPlan, epoch: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
        """Every step's row ids cut into W runs (one per rank), and the ids of rows the epoch
        already trained before ``plan.offset``."""
        orders = [epoch_order(n, self.seed, epoch, j) * self.shards + j for j, n in enumerate(self.shard_rows)]
        world, pieces = self.ranks.world_size, []
        for step in range(plan.steps):
            ids = torch.cat([plan.positions(order, step) for order in orders if len(order)])
            cuts = [len(ids) * w // world for w in range(world + 1)]
            pieces.append([ids[cuts[w]:cuts[w + 1]] for w in range(world)])
        done = torch.cat([order[:min(plan.offset, len(order))] for order in orders])
        return pieces, done


def to_canonical(table: Table, counts: list[int], shards: int, shard_batch: int, seed: int, ranks: Ranks,
                 budget: int | None = None) -> CanonicalRows:
    """Collective: hashes this rank's rows, gathers every rank's hashes and regroups the
    rows so that this rank holds ids ``rank, rank + W, ...`` of the run's order.

    Args:
        table: This rank's training rows, in the agreed layouts.
        counts: Training rows of every rank.
    """
    keys = row_keys(table)
    world, most = ranks.world_size, max(counts)
    if world > 1:
        padded = torch.zeros(most, dtype=torch.int64)
        padded[:len(keys)] = keys
        gathered = [torch.empty(most, dtype=torch.int64, device=ranks.device) for _ in range(world)]
        dist.all_gather(gathered, padded.to(ranks.device))
        keys = torch.cat([g.cpu()[:n] for g, n in zip(gathered, counts)])
    sorted_at = torch.sort(keys, stable=True).indices
    ids = torch.empty_like(sorted_at)
    ids[sorted_at] = torch.arange(len(keys))
    holders = torch.repeat_interleave(torch.arange(world), torch.tensor(counts))[sorted_at]
    start = sum(counts[:ranks.rank])
    held = ids[start:start + counts[ranks.rank]]
    total = len(keys)
    wanted = [torch.arange(w, total, world) for w in range(world)]
    table = regroup(table, held, holders, wanted, ranks, budget)
    return CanonicalRows(table, total, shards, shard_batch, seed, ranks, budget)


def regroup(table: Table, held: torch.Tensor, holders: torch.Tensor, wanted: list[torch.Tensor], ranks: Ranks,
            budget: int | None) -> Table:
    """Collective: a new table of the rows of ids ``wanted[rank]``, in that order.

    Args:
        table: This rank's rows; row ``i`` has id ``held[i]``.
        holders: The rank that sends each id (every rank holding it agrees on one).
        wanted: The ids each rank needs, in its order.
    """
    rank, world = ranks.rank, ranks.world_size
    local = torch.full((len(holders),), -1, dtype=torch.int64)
    local[held] = torch.arange(len(held))
    mine = wanted[rank]
    source = holders[mine]
    received: dict[int, list[Rows]] = {}
    for sender in range(world):
        for receiver in range(world):
            if sender == receiver:
                continue
            if rank == sender:
                ids = wanted[receiver][holders[wanted[receiver]] == rank]
                if len(ids):
                    for column in table.columns():
                        _send(column, local[ids], receiver, ranks.device)
            elif rank == receiver:
                count = int((source == sender).sum())
                if count:
                    received[sender] = [_receive(column, count, sender, ranks.device) for column in table.columns()]
    within = torch.empty_like(mine)
    for sender in range(world):
        at = torch.nonzero(source == sender).reshape(-1)
        within[at] = torch.arange(len(at)) if sender != rank else local[mine[at]]
    spill = Budget(budget)
    columns: list[Rows] = []
    for c, column in enumerate(table.columns()):
        pieces = [received.get(s, [None] * (c + 1))[c] for s in range(world)]
        if budget is None and isinstance(column, DenseRows):  # one copy, straight into the new tensor
            columns.append(DenseRows(_gathered(column, pieces, source, within, rank)))
            continue
        builder = RowsBuilder(column.dtype, spill if c < len(table.inputs) else None, len(mine))
        step = max(1, _CHUNK_VALUES // max(1, math.prod(column.row_shape or (64,))))
        for start in range(0, len(mine), step):
            stop = min(start + step, len(mine))
            _append(builder, column, pieces, source[start:stop], within[start:stop], rank)
        columns.append(builder.finish(getattr(column, "padding", 0)) or _empty_like(column))
    return table.with_columns(columns)


def _append(builder: RowsBuilder, column: Rows, pieces: list[Rows | None], source: torch.Tensor,
            within: torch.Tensor, rank: int) -> None:
    """Appends the rows ``within`` their sources (this rank's ``column`` or a piece received)."""
    if isinstance(column, RaggedRows):
        lengths = torch.empty(len(source), dtype=torch.int64)
        parts = []
        for sender in torch.unique(source).tolist():
            at = torch.nonzero(source == sender).reshape(-1)
            rows = column if sender == rank else pieces[sender]
            lengths[at] = rows.lengths()[within[at]]
            parts.append((at, [rows.flat(int(i), int(i) + 1) for i in within[at].tolist()]))
        values = [torch.empty(0, dtype=column.dtype)] * len(source)
        for at, flats in parts:
            for i, flat in zip(at.tolist(), flats):
                values[i] = flat
        flat = torch.cat(values) if values else torch.empty(0, dtype=column.dtype)
        builder.append(flat.numpy(), lengths.numpy())
        return
    out = _gathered(column, pieces, source, within, rank)
    if column.row_shape:
        builder.append(out.reshape(-1, *column.row_shape[1:]).numpy(),
                       np.full(len(out), column.row_shape[0], dtype=np.int64), tuple(column.row_shape[1:]))
    else:
        builder.append(out.numpy())


def _gathered(column: DenseRows | SpilledRows, pieces: list[Rows | None], source: torch.Tensor, within: torch.Tensor,
              rank: int) -> torch.Tensor:
    """The rows ``within`` their sources (this rank's ``column`` or a piece received), as one tensor."""
    out = torch.empty((len(source), *column.row_shape), dtype=column.dtype)
    senders = torch.unique(source).tolist()
    if senders == [rank] and isinstance(column, DenseRows):
        return torch.index_select(column.tensor, 0, within, out=out)
    for sender in senders:
        at = torch.nonzero(source == sender).reshape(-1)
        out[at] = column.take(within[at]) if sender == rank else pieces[sender].take(within[at])
    return out


def _empty_like(column: Rows) -> Rows:
    if isinstance(column, RaggedRows):
        return RaggedRows(DenseRows(torch.empty(0, dtype=column.dtype)), torch.zeros(1, dtype=torch.int64),
                          column.padding)
    return DenseRows(torch.empty(0, *column.row_shape, dtype=column.dtype))


def _send(column: Rows, positions: torch.Tensor, destination: int, device: torch.device) -> None:
    if isinstance(column, RaggedRows):
        lengths = column.lengths()[positions]
        flat = torch.cat([column.flat(int(p), int(p) + 1) for p in positions.tolist()]) if len(positions) else \
            torch.empty(0, dtype=column.dtype)
        dist.send(lengths.to(device), destination)
        dist.send(flat.contiguous().to(device), destination)
    else:
        dist.send(column.take(positions).contiguous().to(device), destination)


def _receive(column: Rows, rows: int, source: int, device: torch.device) -> Rows:
    if isinstance(column, RaggedRows):
        lengths = torch.empty(rows, dtype=torch.int64, device=device)
        dist.recv(lengths, source)
        values = torch.empty(int(lengths.sum()), dtype=column.dtype, device=device)
        dist.recv(values, source)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths.cpu(), 0)])
        return RaggedRows(DenseRows(values.cpu()), offsets, column.padding)
    received = torch.empty((rows, *column.row_shape), dtype=column.dtype, device=device)
    dist.recv(received, source)
    return DenseRows(received.cpu())
