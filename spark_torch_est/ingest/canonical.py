"""[executor] One epoch order on any number of ranks: logical shards fixed by the run.

A run fixes ``shards`` (L) when it starts: its first world size, recorded in its checkpoints.
Every row has a place in the run, position ``i`` of logical shard ``j`` (its id ``i * L + j``),
that does not depend on how many ranks read the rows. Where the rows come in an order every
launch reproduces, the places come from it and nothing is hashed: a Parquet table's files
read directly (:func:`by_source_order`: the file listing and row offsets; the ``k``-th
training row of the table is in the ``k``-th of L near-equal runs of rows, the longer
first), and rows through Spark from a DataFrame whose plan reproduces its order
(:func:`by_partition_order`: the training frame is cut into L logical partitions, partition
``j`` being shard ``j``). On L ranks each rank then read its logical shard's rows and nothing
moves. Elsewhere (a shuffle in the DataFrame's plan, Spark Connect) the ranks hash each
training row's bytes (every column, :func:`row_keys`) once per launch and sort the hashes
across the ranks (:func:`run_ids`): the row with the ``g``-th smallest hash is row ``g``;
identical rows hash alike and are interchangeable (:func:`to_canonical`, said in the log
with what it took).
An epoch's order is then a function of ``(seed, epoch)`` and the rows' places: shard ``j``
visits its rows in :func:`epoch_order` ``(rows of j, seed, epoch, j)``, and global step
``s`` trains positions ``s * b`` onwards of every shard's order (``b``: rows per shard per
step, the global batch over L; :class:`EpochPlan`); a shard with fewer rows than another
has none left in the epoch's last steps.

On L ranks (the usual case) rank ``r`` holds logical shard ``r`` and trains its part of each
step, exactly the loop of a fixed world size: no exchange after the one at the launch.
On W != L ranks (a shrink, a grow, a later fit with another ``numWorkers``) the rows of
each step are cut into W runs of near-equal length, rank ``w`` training the ``w``-th; at
the start of each epoch the ranks move (all to all, tensors only: :func:`stream_rows`) the
rows each needs for it, so every rank holds about ``1/W`` of the rows: streamed, the memory
of rows sent given back as they go, the rows received kept in the order they came and
trained through an index. At the launch the rows stay where they were read: the first
epoch's move is the only one.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from spark_torch_est.core.ranks import Ranks
from spark_torch_est.ingest.columns import Column, DenseColumn, RaggedColumn, SpilledColumn, spill_file
from spark_torch_est.ingest.tables import Table

__all__ = ["EpochPlan", "epoch_order", "epoch_offset", "row_keys", "CanonicalRows", "EpochRows", "to_canonical",
           "by_source_order", "by_partition_order", "source_ids", "run_places", "near_equal", "even_enough",
           "PARTITION_SHIFT", "move_rows", "stream_rows", "slots_of"]

logger = logging.getLogger(__name__)

_CHUNK_VALUES = 1 << 18  # values hashed, or sent by a rank in one round, at once (2 MB temporaries each)
_CHUNK_ROWS = 1 << 16  # rows whose places a move works out at once, or sends in one round at most
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


def _column_keys(rows: Column, by_value: bool = False) -> np.ndarray:
    """A key per row of one column, read in chunks (spilled rows stay on disk); ``by_value``:
    of the values as float64, so that 3 and 3.0 hash alike."""
    count, keys = len(rows), []

    def bits(values: torch.Tensor) -> np.ndarray:
        return _bits(values.to(torch.float64) if by_value else values)

    if isinstance(rows, RaggedColumn):
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


class EpochPlan:
    """Which rows every rank takes at each step of (the rest of) an epoch.

    All ranks take the same number of steps. Step ``k`` takes rows ``offset + k *
    batch_size`` onwards of each rank's order, as many as are left: the last step is short
    (a rank may have no rows in it), never filled by repeating rows, so an epoch trains
    every row once.

    Args:
        rows: Training rows of every rank.
        batch_size: Rows per rank per step.
        offset: Rows of its order each rank already trained on in this epoch.

    >>> plan = EpochPlan([5, 4], batch_size=2, offset=2)
    >>> plan.steps, [plan.samples(k) for k in range(plan.steps)]
    (2, [4, 1])
    """

    def __init__(self, rows: list[int], batch_size: int, offset: int = 0) -> None:
        self.rows = list(rows)
        self.batch_size = batch_size
        self.offset = offset
        self.steps = max(math.ceil((max(self.rows) - offset) / batch_size), 0)

    def positions(self, order: torch.Tensor, step: int) -> torch.Tensor:
        """The positions of this rank's rows for ``step`` (counted from the plan's start)."""
        start = self.offset + step * self.batch_size
        return order[start:start + self.batch_size]

    def samples(self, step: int) -> int:
        """Rows all ranks together train on at ``step``."""
        start = self.offset + step * self.batch_size
        return sum(min(self.batch_size, max(n - start, 0)) for n in self.rows)


def epoch_offset(shard_rows: list[int], done: int) -> int:
    """Rows of each logical shard's order an epoch trained once its steps trained ``done``
    rows of all shards together (each shard ``min(its rows, offset)``).

    >>> epoch_offset([10, 4], 10)  # two steps of 3 rows per shard: 3 + 3, then 3 + 1
    6
    """
    rows, low, high = torch.tensor(shard_rows), 0, max(shard_rows)
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if int(rows.clamp(max=middle).sum()) < done else (low, middle)
    return low


def epoch_order(num_rows: int, seed: int, epoch: int, part: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The shuffled row order of one rank's part in one epoch, a pure function of its
    arguments (the same order in any integer ``dtype`` that holds it)."""
    state = np.random.SeedSequence([seed, epoch, part]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    return torch.randperm(num_rows, generator=generator, dtype=dtype)


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
    _slots: torch.Tensor | None = None  # where the table holds the row of each position (None: in order)

    def take(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """This rank's rows of ``step`` (counted from the plan's start): ``(inputs, labels, weights)``."""
        if self._order is not None:
            return self.table.take(self.plan.positions(self._order, step))
        bounds, slots = self._bounds, self._slots
        if bounds is None or slots is None:
            raise ValueError("EpochRows needs the rank's order, or the bounds of its steps and its rows' slots")
        return self.table.take(slots[int(bounds[step]):int(bounds[step + 1])].long())

    def samples(self, step: int) -> int:
        """Rows all ranks together train on at ``step``."""
        return self.plan.samples(step)

    def stand_in(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """The row at this rank's first position (the same row whatever order the table
        holds its rows in), for a step in which the rank trains none."""
        first = int(self._slots[0]) if self._slots is not None and len(self._slots) else 0
        return self.table.slice(first, first + 1)


class CanonicalRows:
    """A rank's training rows in the run's logical shards, and each epoch's rows of the rank.

    Row ``i`` of logical shard ``j`` has the id ``i * L + j`` in the run.

    Args:
        table: The rows this rank holds: on L ranks, logical shard ``rank``'s (in position
            order, or where ``slots`` says); elsewhere any rows, ``ids`` saying which.
        shard_rows: Training rows of each logical shard (L of them).
        shard_batch: Rows of each shard per global step.
        seed: The run's seed.
        ranks: This rank and the world.
        budget: Bytes of input rows kept in RAM before they spill (None: never).
        ids: The run ids of ``table``'s rows (None on L ranks: those of logical shard ``rank``).
        slots: On L ranks, where ``table`` holds the row of each position of the logical
            shard (rows laid out by :func:`stream_rows`); None: row ``i`` is position ``i``.
    """

    def __init__(self, table: Table, shard_rows: list[int], shard_batch: int, seed: int, ranks: Ranks,
                 budget: int | None = None, ids: torch.Tensor | None = None,
                 slots: torch.Tensor | None = None) -> None:
        self.table, self.shard_rows, self.shards, self.slots = table, list(shard_rows), len(shard_rows), slots
        self.shard_batch = shard_batch
        self.seed, self.ranks, self.budget = seed, ranks, budget
        if ids is None:
            if ranks.world_size != self.shards:
                raise ValueError(f"rows on {ranks.world_size} ranks in {self.shards} logical shards need their ids")
            ids = torch.arange(self.shard_rows[ranks.rank], dtype=torch.int64) * self.shards + ranks.rank
        self.ids = ids  # the run ids of the rows this rank holds
        self.moved: Callable[[Table], None] = lambda table: None  # told the table after each move

    def epoch(self, epoch: int, offset: int) -> EpochRows:
        """Collective on W != L ranks: the rows this rank trains in ``epoch`` from ``offset``
        rows of each shard's order on, exchanged with the other ranks first."""
        plan = EpochPlan(self.shard_rows, self.shard_batch, offset)
        if self.ranks.world_size == self.shards:
            order = epoch_order(len(self.table), self.seed, epoch, self.ranks.rank)
            if self.slots is not None:
                order = self.slots[order].long()
            return EpochRows(self.table, plan, plan.steps, _order=order, _slots=self.slots)
        rank = self.ranks.rank
        to_rank, to_position, pieces, sizes = self._destinations(plan, epoch)
        self.table, arrived, carry = stream_rows(self.table, to_rank, to_position, int(sizes[rank]), self.ranks,
                                                 self.budget)
        self.ids = carry(self.ids)
        self.moved(self.table)
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(pieces[:, rank], 0)])
        slots = slots_of(arrived)
        return EpochRows(self.table, plan, plan.steps, _bounds=bounds, _slots=slots)

    def _destinations(self, plan: EpochPlan, epoch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
        """Where this rank's rows go for the epoch of ``plan``: ``(to_rank, to_position,
        pieces, sizes)``, the rank and position of each of its rows, every step's rows per
        rank (``[steps, W]``) and every rank's rows in all.

        Step ``s`` trains the rows at places ``offset + s * b`` onwards of each shard's order
        (``b`` of them, fewer at a shard's end), shard 0's first, cut into W near-equal
        runs, rank ``w`` training the ``w``-th: a rank's rows are its runs of every step in
        turn, then the rows it will hold that the epoch trained before ``offset`` (those of
        id ``w`` modulo W, by shard and place). Each shard's order is drawn once, and only
        this rank's rows are looked up in it: the rank holds no list of all ids."""
        world, shards, b, offset = self.ranks.world_size, self.shards, self.shard_batch, plan.offset
        starts = offset + torch.arange(plan.steps, dtype=torch.int64) * b
        per_shard = (torch.tensor(self.shard_rows)[None, :] - starts[:, None]).clamp(0, b)  # [s, j]
        in_step = per_shard.sum(1)
        shards_before = torch.cumsum(per_shard, 1) - per_shard
        cuts = in_step[:, None] * torch.arange(world + 1)[None, :] // world  # [s, w + 1]: the runs' starts
        pieces = cuts[:, 1:] - cuts[:, :-1]
        steps_before = torch.cumsum(pieces, 0) - pieces
        held = pieces.sum(0)  # [w]: each rank's rows so far (its runs, then those trained before the offset)
        to_rank, to_position = (torch.empty(len(self.ids), dtype=torch.int32) for _ in range(2))
        for j, count in enumerate(self.shard_rows):
            order = epoch_order(count, self.seed, epoch, j, dtype=torch.int32)  # half the memory of int64
            trained = ((order[:min(offset, count)].long() * shards + j) % world).int()  # their ranks
            trained_at = torch.empty_like(trained)
            for w in range(world):
                going = trained == w
                trained_at[going] = int(held[w]) + torch.arange(int(going.sum()), dtype=torch.int32)
                held[w] += int(going.sum())
            place = torch.empty_like(order)
            for start in range(0, count, _CHUNK_ROWS):  # the inverse of the order, a chunk of rows at a time
                place[order[start:start + _CHUNK_ROWS].long()] = torch.arange(start, min(start + _CHUNK_ROWS, count),
                                                                             dtype=torch.int32)
            del order
            for start in range(0, len(self.ids), _CHUNK_ROWS):
                ids = self.ids[start:start + _CHUNK_ROWS]
                own = torch.nonzero(ids % shards == j).squeeze(1)
                q = place[ids[own] // shards].long()  # these rows' places in the shard's order
                own += start
                done = q < offset
                to_rank[own[done]], to_position[own[done]] = trained[q[done]], trained_at[q[done]]
                own, q = own[~done], q[~done] - offset
                step, at = q // b, shards_before[q // b, j] + q % b  # the row's step and place in it
                run = ((at + 1) * world + in_step[step] - 1) // in_step[step] - 1  # the run (rank) it falls in
                to_rank[own], to_position[own] = run.int(), (steps_before[step, run] + at - cuts[step, run]).int()
        return to_rank, to_position, pieces, held


def near_equal(total: int, shards: int) -> list[int]:
    """Rows of each of ``shards`` near-equal logical shards of ``total`` rows, the longer first."""
    return [len(range(j, total, shards)) for j in range(shards)]


def _laid_out(table: Table, ids: torch.Tensor, shard_rows: list[int], shard_batch: int, seed: int, ranks: Ranks,
              budget: int | None, in_place: bool = False) -> CanonicalRows:
    """Collective on L ranks unless ``in_place``: the rows of run ids ``ids``, moved so that
    rank ``r`` holds logical shard ``r`` (streamed: in the order they arrive, with each
    position's slot). On W != L ranks they stay where they are (each epoch moves the rows
    it needs, see :meth:`CanonicalRows.epoch`)."""
    shards = len(shard_rows)
    if ranks.world_size != shards:
        return CanonicalRows(table, shard_rows, shard_batch, seed, ranks, budget, ids)
    if in_place:
        return CanonicalRows(table, shard_rows, shard_batch, seed, ranks, budget)
    to_rank, to_position = (torch.empty(len(ids), dtype=torch.int32) for _ in range(2))
    for start in range(0, len(ids), _CHUNK_ROWS):  # a chunk at a time: a few temporaries of its size
        to_rank[start:start + _CHUNK_ROWS] = ids[start:start + _CHUNK_ROWS] % shards
        to_position[start:start + _CHUNK_ROWS] = ids[start:start + _CHUNK_ROWS] // shards
    table, positions, _ = stream_rows(table, to_rank, to_position, shard_rows[ranks.rank], ranks, budget)
    return CanonicalRows(table, shard_rows, shard_batch, seed, ranks, budget, slots=slots_of(positions))


def to_canonical(table: Table, counts: list[int], shards: int, shard_batch: int, seed: int, ranks: Ranks,
                 budget: int | None = None) -> CanonicalRows:
    """Collective: places every row in the run's order by hashing it (:func:`run_ids`), for
    rows whose order no launch can reproduce; on L ranks they move to their logical shards.

    Args:
        table: This rank's training rows, in the agreed layouts.
        counts: Training rows of every rank.
    """
    started = time.perf_counter()
    ids = run_ids(row_keys(table), ranks)
    placed = time.perf_counter()
    canonical = _laid_out(table, ids, near_equal(sum(counts), shards), shard_batch, seed, ranks, budget)
    moved = f" and moved them to their logical shards ({time.perf_counter() - placed:.2f}s)" \
        if ranks.world_size == shards else ""
    logger.info("rank %d: placed its %d training rows in the run by hashing them (%.2fs)%s", ranks.rank,
                counts[ranks.rank], placed - started, moved)
    return canonical


def source_ids(counts: list[int], rank: int, shards: int) -> torch.Tensor:
    """The places in the run of this rank's training rows, when the ranks hold the source's
    rows in its order (rank 0's first, each rank's in order): see :func:`run_places`. A
    pure function of the source's order, whatever the number of ranks.

    >>> source_ids([3, 2], 1, shards=2).tolist()  # rows 3, 4 of 5: shards of 3 and 2 rows
    [1, 3]
    """
    start = sum(counts[:rank])
    return run_places(torch.arange(start, start + counts[rank], dtype=torch.int64), sum(counts), shards)


def run_places(rows: torch.Tensor, total: int, shards: int) -> torch.Tensor:
    """The run ids of ``rows`` (their places ``k`` in a source of ``total`` rows): the
    ``k``-th row is in the ``k``-th of ``shards`` near-equal runs of rows (the longer first),
    ``j``, at position ``i`` of it: id ``i * shards + j``."""
    size, longer = divmod(total, shards)
    first = longer * (size + 1)  # rows in the longer runs
    ids = torch.empty_like(rows)
    for start in range(0, len(rows), _CHUNK_ROWS):  # a chunk at a time: a few temporaries of its size
        part = rows[start:start + _CHUNK_ROWS]
        shard = torch.where(part < first, part // (size + 1), longer + (part - first) // max(size, 1))
        ids[start:start + _CHUNK_ROWS] = (part - shard * size - torch.clamp(shard, max=longer)) * shards + shard
    return ids


def by_source_order(table: Table, counts: list[int], shards: int, shard_batch: int, seed: int, ranks: Ranks,
                    budget: int | None = None) -> CanonicalRows:
    """:func:`to_canonical` for rows that the ranks hold in the source's own order (see
    :func:`source_ids`): nothing is hashed; on as many ranks as logical shards, each holding
    its logical shard's rows (parts split as the logical shards are), nothing moves and there is no collective.

    Args:
        table: This rank's training rows, in the agreed layouts and the source's order.
        counts: Training rows of every rank.
    """
    shard_rows = near_equal(sum(counts), shards)
    if ranks.world_size == shards and counts == shard_rows:
        logger.debug("rank %d: its %d training rows are its logical shard as read: none moves", ranks.rank,
                     counts[ranks.rank])
        return CanonicalRows(table, shard_rows, shard_batch, seed, ranks, budget)
    started = time.perf_counter()
    canonical = _laid_out(table, source_ids(counts, ranks.rank, shards), shard_rows, shard_batch, seed, ranks, budget)
    if ranks.world_size != shards:
        logger.debug("rank %d: its %d training rows are placed by the source's order: none moves at launch",
                     ranks.rank, counts[ranks.rank])
    else:
        logger.info("rank %d: moved its %d training rows to their logical shards, placed by the source's order "
                    "(%.2fs)", ranks.rank, counts[ranks.rank], time.perf_counter() - started)
    return canonical


#: A row's logical partition in a training frame's row id (its position there in the bits below).
PARTITION_SHIFT = 33  # as Spark's monotonically_increasing_id


def by_partition_order(table: Table, counts: list[int], row_ids: torch.Tensor | None, shards: int, shard_batch: int,
                       seed: int, ranks: Ranks, budget: int | None = None) -> CanonicalRows:
    """:func:`to_canonical` for rows through Spark whose order every launch reproduces: the
    training frame's L logical partitions (see :func:`~spark_torch_est.ingest.frames.training_frame`),
    partition ``j`` being logical shard ``j``, its training rows in the partition's order.
    Nothing is hashed. On L ranks each rank read its partition whole (``row_ids`` None):
    nothing moves and there is no collective. On W != L ranks each row came with its
    partition and position in it (``row_ids``, see :data:`PARTITION_SHIFT`): the ranks share
    them once to number each shard's training rows, and the rows stay where they are.

    Partitions of very different lengths (a DataFrame of L partitions read as it is) would
    leave the epoch's last steps to the longest: unless they are :func:`even_enough`, the
    shards are L near-equal runs of the partitions' rows one after the other (on L ranks
    the rows that cross a run's end move once, at the launch).

    Args:
        table: This rank's training rows, in the agreed layouts.
        counts: Training rows of every rank.
        row_ids: The training rows' ids in the frame, or None when this rank read logical partition ``rank`` whole.

    Raises:
        ValueError: Row ids missing on W != L ranks, or of another number of logical partitions.
    """
    world, started = ranks.world_size, time.perf_counter()
    if row_ids is None:
        if world != shards:
            raise ValueError(f"rows through Spark on {world} ranks in {shards} logical partitions need their row ids")
        if even_enough(counts):
            logger.debug("rank %d: its %d training rows are logical partition %d as read: none moves", ranks.rank,
                         counts[ranks.rank], ranks.rank)
            return CanonicalRows(table, counts, shard_batch, seed, ranks, budget)
        partition_rows, first = counts, sum(counts[:ranks.rank])
        placed = torch.arange(first, first + counts[ranks.rank])  # in all partitions' rows, one after the other
    else:
        every = torch.sort(ranks.exchange(row_ids.repeat(world), [len(row_ids)] * world, counts)).values
        if len(every) and int(every[-1] >> PARTITION_SHIFT) >= shards:
            raise ValueError(f"rows of logical partition {int(every[-1] >> PARTITION_SHIFT)} in a run of {shards}")
        partition_rows = torch.bincount(every >> PARTITION_SHIFT, minlength=shards).tolist()
        placed = torch.searchsorted(every, row_ids)
        del every
        if even_enough(partition_rows):  # each partition is its logical shard: nothing moves
            starts = torch.tensor([sum(partition_rows[:j]) for j in range(shards)], dtype=torch.int64)
            partition = row_ids >> PARTITION_SHIFT
            canonical = _laid_out(table, (placed - starts[partition]) * shards + partition, partition_rows,
                                  shard_batch, seed, ranks, budget, in_place=True)
            _log_placed(ranks, counts, shards, "", started)
            return canonical
    ids = run_places(placed, sum(partition_rows), shards)
    del placed
    canonical = _laid_out(table, ids, near_equal(sum(partition_rows), shards), shard_batch, seed, ranks, budget)
    _log_placed(ranks, counts, shards, f", evened out as they hold {min(partition_rows)} to {max(partition_rows)} rows",
                started)
    return canonical


def _log_placed(ranks: Ranks, counts: list[int], shards: int, moved: str, started: float) -> None:
    logger.info("rank %d: placed its %d training rows by %d logical partitions on %d ranks%s (%.2fs)", ranks.rank,
                counts[ranks.rank], shards, ranks.world_size, moved, time.perf_counter() - started)


def even_enough(rows: list[int]) -> bool:
    """Whether logical partitions of ``rows`` rows each are the run's logical shards as they
    are: within 1% (at least 64 rows) of each other, as dealing the rows out by position makes them."""
    return max(rows) - min(rows) <= max(64, min(rows) // 100)


def run_ids(keys: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Collective: each row's id in the run, its key's place among every rank's keys (ties
    by rank, then by row). The keys are sorted across the ranks: rank ``w`` sorts those in
    the ``w``-th of W equal parts of the key range (the keys are uniform hashes, so about
    ``1/W`` of them) and sends their places back, so no rank holds every rank's keys."""
    world, rank = ranks.world_size, ranks.rank
    values, order = torch.sort(keys, stable=True)
    flipped = values.numpy().view(np.uint64) ^ np.uint64(1 << 63)  # in the keys' order, as unsigned
    part = torch.from_numpy(((flipped >> np.uint64(32)) * np.uint64(world) >> np.uint64(32)).astype(np.int64))
    del flipped
    matrix = ranks.counts(torch.bincount(part, minlength=world))  # [s, w]: keys rank s sends rank w
    del part
    sent, received = matrix[rank].tolist(), matrix[:, rank].tolist()
    arrived = ranks.exchange(values, sent, received)  # by sender, each sender's in order
    del values
    start = int(matrix[:, :rank].sum())
    places = torch.empty(len(arrived), dtype=torch.int64)
    places[torch.sort(arrived, stable=True).indices] = torch.arange(start, start + len(arrived))
    del arrived
    ids = torch.empty(len(keys), dtype=torch.int64)
    ids[order] = ranks.exchange(places, received, sent)
    return ids


def move_rows(table: Table, to_rank: torch.Tensor, to_position: torch.Tensor, size: int, ranks: Ranks,
              budget: int | None) -> Table:
    """Collective: this rank's new table of ``size`` rows, row ``i`` of every rank's
    ``table`` going to row ``to_position[i]`` of rank ``to_rank[i]``'s.

    The rows travel one column at a time, in rounds of about :data:`_CHUNK_VALUES` values (at
    most :data:`_CHUNK_ROWS` rows) from each rank, straight to their places in the new column:
    a rank holds its old rows, its new ones and one round. Input columns spilled to disk stay
    on disk, and so do those that would pass ``budget`` (bytes of input rows in RAM).

    Raises:
        ValueError: The ranks' positions do not fill this rank's ``size`` rows once each.
    """
    return _move(table, to_rank, to_position, size, ranks, budget, streamed=False)[0]


def stream_rows(table: Table, to_rank: torch.Tensor, to_position: torch.Tensor, size: int, ranks: Ranks,
                budget: int | None) -> tuple[Table, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Collective: :func:`move_rows`, holding the old rows and the new ones together only a
    round at a time: ``(new table, positions, carry)``, the new rows in the order they
    arrive, row ``k`` being the one for position ``positions[k]`` (see :func:`slots_of`);
    ``carry(values)`` (collective) sends one value per row of ``table`` the same way, in the
    new rows' order. Each rank sends its rows in the order it holds them and gives each
    round's memory back once it is sent (``table`` is not read again), and each new column
    fills from its start (one front per sender), so a rank's memory holds its rows not yet
    sent, those received and one round (up to a chunk from each rank).

    Raises:
        ValueError: The ranks' positions do not fill this rank's ``size`` rows once each.
    """
    moved, route, places = _move(table, to_rank, to_position, size, ranks, budget, streamed=True)
    return moved, places, route.arrive


def slots_of(positions: torch.Tensor) -> torch.Tensor:
    """Where a table whose row ``k`` is the one for position ``positions[k]`` (a permutation)
    holds each position's row: the inverse permutation, worked out a chunk at a time."""
    slots = torch.empty_like(positions)
    for start in range(0, len(positions), _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, len(positions))
        slots[positions[start:stop].long()] = torch.arange(start, stop, dtype=slots.dtype)
    return slots


def _move(table: Table, to_rank: torch.Tensor, to_position: torch.Tensor, size: int, ranks: Ranks,
          budget: int | None, streamed: bool) -> tuple[Table, _Route, torch.Tensor]:
    """:func:`move_rows` (the new rows at their positions), or :func:`stream_rows`: the new
    table, the route its rows took and the positions of the rows in the order they arrived."""
    route = _Route(to_rank, ranks)
    places = route.arrive(to_position)  # of the arriving rows, by sender, each sender's in the order it holds them
    if not _fills_once(places, size):
        raise ValueError(f"rank {ranks.rank}: the ranks' rows do not fill its {size} rows once each")

    def slots(numbers: torch.Tensor) -> torch.Tensor:  # where arriving rows go
        return numbers if streamed else places[numbers].long()

    released = _releasable(table) if streamed else set()
    in_ram, columns = 0, list[Column]()
    for c, column in enumerate(table.columns()):
        spillable = budget is not None and c < len(table.inputs)
        if isinstance(column, RaggedColumn):
            own_lengths, lengths = column.lengths(), torch.empty(size, dtype=torch.int64)
            lengths[slots(torch.arange(size))] = route.arrive(own_lengths)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
            target = _Target(int(offsets[-1]), (), column.dtype, isinstance(column.values, SpilledColumn)
                             or spillable and in_ram + _nbytes(int(offsets[-1]), (), column.dtype) > (budget or 0))
            width = route.mean(len(column.values))
            for rows, numbers, sent in route.rounds(_CHUNK_VALUES // width):
                at = slots(numbers)
                got = ranks.exchange(_flat(column, rows, own_lengths[rows]), route.sending(own_lengths[rows]),
                                     route.arriving(lengths[at]))
                target.write(_spans(offsets[at], lengths[at]), got)
                if c in released and isinstance(column.values, DenseColumn):
                    column.values.release(int(column.offsets[sent]))
            columns.append(RaggedColumn(target.rows(), offsets, column.padding))
        else:
            target = _Target(size, column.row_shape, column.dtype, isinstance(column, SpilledColumn)
                             or spillable and in_ram + _nbytes(size, column.row_shape, column.dtype) > (budget or 0))
            for rows, numbers, sent in route.rounds(_CHUNK_VALUES // max(1, math.prod(column.row_shape))):
                target.write(slots(numbers), ranks.exchange(column.take(rows), route.sending(), route.arriving()))
                if c in released and isinstance(column, DenseColumn):
                    column.release(sent)
            columns.append(target.rows())
        in_ram += 0 if target.file is not None else target.nbytes
    return table.with_columns(columns), route, places


def _fills_once(places: torch.Tensor, size: int) -> bool:
    """Whether ``places`` name each of ``size`` positions once (as many of them, none twice)."""
    if len(places) != size or (size and int(places.min()) < 0):
        return False
    filled = torch.zeros(size, dtype=torch.bool)
    try:
        for start in range(0, size, _CHUNK_ROWS):
            filled[places[start:start + _CHUNK_ROWS].long()] = True
    except IndexError:  # a place past the last
        return False
    return bool(filled.all())


def _releasable(table: Table) -> set[int]:
    """The columns (by place in ``table.columns()``) whose rows in RAM no other column's
    share, whose memory a move may give back as it sends them."""
    spans = {}
    for c, column in enumerate(table.columns()):
        rows = column.values if isinstance(column, RaggedColumn) else column
        if isinstance(rows, DenseColumn) and rows.tensor.numel():
            tensor = rows.tensor  # the bytes it reads, however strided
            last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
            spans[c] = (tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size())
    return {c for c, (begin, end) in spans.items()
            if not any(b < end and begin < e for d, (b, e) in spans.items() if d != c)}


class _Route:
    """Which rows of this rank go to which rank, and which arrive from which, in rounds.

    Args:
        to_rank: The rank each row of this rank goes to.
        ranks: This rank and the world.
    """

    def __init__(self, to_rank: torch.Tensor, ranks: Ranks) -> None:
        self.ranks, self.to_rank, world = ranks, to_rank, ranks.world_size
        matrix = ranks.counts(torch.bincount(to_rank, minlength=world)).tolist()  # [s][w]: rows s sends w
        self.sent, self.received = matrix[ranks.rank], [sent[ranks.rank] for sent in matrix]
        self._received_at = [sum(self.received[:w]) for w in range(world)]
        self._most = max(sum(sent) for sent in matrix)  # rows of the rank that holds most
        self._rows = sum(map(sum, matrix))  # of all ranks

    def arrive(self, values: torch.Tensor) -> torch.Tensor:
        """Collective: one value per row of this rank (``values``) sent with the rows; those
        of the rows arriving here, by sender, each sender's in the order it holds them (the
        numbers :meth:`rounds` gives them). Grouped by the rank they go to a chunk at a time."""
        grouped, at = torch.empty_like(values), [sum(self.sent[:w]) for w in range(self.ranks.world_size)]
        for start in range(0, len(values), _CHUNK_ROWS):
            going = self.to_rank[start:start + _CHUNK_ROWS]
            part = values[start:start + _CHUNK_ROWS][torch.sort(going, stable=True).indices]
            taken = 0
            for w, n in enumerate(torch.bincount(going, minlength=len(at)).tolist()):
                grouped[at[w]:at[w] + n] = part[taken:taken + n]
                at[w], taken = at[w] + n, taken + n
        return self.ranks.exchange(grouped, self.sent, self.received)

    def mean(self, local: int) -> int:
        """Collective: ``local`` summed over the ranks, per row of all ranks (at least 1)."""
        total = int(self.ranks.all_reduce(torch.tensor([local], dtype=torch.int64))[0])
        return max(1, total // max(1, self._rows))

    def rounds(self, values: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """Collective: the same rounds on every rank, each sending the next ``values`` rows
        (at least one, at most :data:`_CHUNK_ROWS`) a rank holds, in the order it holds them
        (a rank may receive up to W times that in a round): ``(rows, numbers, sent)``,
        this rank's rows sent in the round (by the rank they go to), the numbers of those
        arriving (see :meth:`arrive`) and how many of its first rows are sent once it ends."""
        world, chunk, held = self.ranks.world_size, max(1, min(values, _CHUNK_ROWS)), len(self.to_rank)
        count = -(-self._most // chunk)
        mine = torch.zeros(count * world, dtype=torch.int64)  # [k, w]: rows sent to w in round k
        for start in range(0, held, _CHUNK_ROWS):
            part = self.to_rank[start:start + _CHUNK_ROWS]
            mine += torch.bincount(torch.arange(start, start + len(part)) // chunk * world + part,
                                   minlength=count * world)
        mine = mine.reshape(count, world)
        arriving = self.ranks.exchange(mine.T.reshape(-1), [count] * world, [count] * world).reshape(world, count)
        sends, arrivals = torch.stack([mine, arriving.T]).tolist()  # [k][w] sent, [k][s] arriving
        arrived = list(self._received_at)  # the number of the next row arriving from each rank
        for k in range(count):
            self._round = list(zip(sends[k], arrivals[k]))
            first = min(k * chunk, held)
            rows = first + torch.sort(self.to_rank[first:first + chunk], stable=True).indices
            numbers = torch.cat([torch.arange(at, at + m) for at, m in zip(arrived, arrivals[k])])
            arrived = [at + m for at, m in zip(arrived, arrivals[k])]
            yield rows, numbers, min(first + chunk, held)

    def sending(self, sizes: torch.Tensor | None = None) -> list[int]:
        """How many values this round sends each rank: one per row, or ``sizes`` (per row sent)."""
        return _values([n for n, _ in self._round], sizes)

    def arriving(self, sizes: torch.Tensor | None = None) -> list[int]:
        """How many values this round receives from each rank (see :meth:`sending`)."""
        return _values([m for _, m in self._round], sizes)


def _values(rows: list[int], sizes: torch.Tensor | None) -> list[int]:
    """Values per rank of ``rows`` rows per rank: one a row, or ``sizes`` (one per row, in rank order)."""
    return rows if sizes is None else [int(part.sum()) for part in torch.split(sizes, rows)]


class _Target:
    """A new column's values, in RAM or in a local file, written at their positions.

    Args:
        count: Rows of ``row_shape``.
        to_disk: Write them to a file under Spark's local directory.
    """

    def __init__(self, count: int, row_shape: tuple[int, ...], dtype: torch.dtype, to_disk: bool) -> None:
        self.count, self.row_shape, self.dtype = count, tuple(row_shape), dtype
        self.nbytes = _nbytes(count, row_shape, dtype)
        self.file = spill_file() if to_disk else None
        self.tensor = None if to_disk else torch.empty((count, *row_shape), dtype=dtype)
        if self.file is not None:
            self.file.truncate(self.nbytes)

    def write(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Puts ``rows`` at ``positions``; on disk one write per run of consecutive positions."""
        if self.tensor is not None:
            self.tensor[positions] = rows
            return
        if self.file is None or not len(positions):
            return
        order = torch.argsort(positions)
        at, data = positions[order].numpy(), rows[order].contiguous().numpy()
        breaks = np.flatnonzero(np.diff(at) != 1) + 1
        row_bytes = self.nbytes // max(self.count, 1)
        view = data.reshape(len(at), -1).view(np.uint8)
        for first, last in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(at)]])):
            os.pwrite(self.file.fileno(), view[first:last].tobytes(), int(at[first]) * row_bytes)

    def rows(self) -> DenseColumn | SpilledColumn:
        if self.tensor is not None:
            return DenseColumn(self.tensor)
        return SpilledColumn(self.file, self.count, self.row_shape, self.dtype)


def _nbytes(count: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return count * math.prod(row_shape) * torch.empty(0, dtype=dtype).element_size()


def _spans(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Positions ``starts[i]`` to ``starts[i] + lengths[i]`` of every ``i``, one after the other."""
    ends = torch.cumsum(lengths, 0)
    return torch.repeat_interleave(starts - (ends - lengths), lengths) + torch.arange(int(ends[-1]) if len(ends) else 0)


def _flat(column: RaggedColumn, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The values of ``rows`` (of ``lengths``) of a ragged column, unpadded, one after the other."""
    starts = column.offsets[rows]
    if isinstance(column.values, DenseColumn):
        return column.values.tensor[_spans(starts, lengths)]
    parts = [column.values.slice(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist())]
    return torch.cat(parts) if parts else torch.empty(0, dtype=column.dtype)
