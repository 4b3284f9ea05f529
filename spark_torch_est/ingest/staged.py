"""[both] The staged rows: a first fit through Spark on one host reads its DataFrame without a shuffle.

The training frame of a fit through Spark deals its rows out to the run's logical
partitions by their positions (:func:`spark_torch_est.ingest.frames.training_frame`): the
row ``k`` of input partition ``p`` has position ``o = p * 2**33 + k`` (what
``monotonically_increasing_id`` numbers it), logical partition ``o mod L`` holds it, in the
order of ``o``. A Spark shuffle moves every row to its partition: its map stage, its fetch
and the sort each cost about as much as Spark's own scan of the rows.

Where every executor runs on the driver's host (local mode, one machine), the rows take
another way there, to the same partitions in the same order:

1. a plain (not barrier) job over the DataFrame's own partitions deals each partition's
   Arrow batches, as Spark hands them to Python, out to one Arrow IPC file per logical
   partition in a folder of the fit (:func:`stage`), about the cost of Spark's scan;
2. each rank of the training job reads the files of its logical partition, input
   partition after input partition (:func:`staged_batches`): what the shuffle would
   have brought it, each row read once by one rank. A rank that keeps its rows for later
   fits keeps these files, hard-linked (:mod:`spark_torch_est.ingest.kept`).

The ranks' rows are thus those of the shuffle, bitwise, so a run may go on either way
(a relaunch, a later fit, a cluster of several hosts). A file that is gone or not as the
job wrote it (a rank on another host than the writer) stops the job before training, and
the fit reads through the shuffle instead (:data:`STAGED_MISSING`). The driver removes
the folder when the fit ends.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from spark_torch_est.core.arrow import from_numpy, to_numpy
from spark_torch_est.core.spec import StagedRows
from spark_torch_est.errors import InputDataError, InvalidInputError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["STAGED_MISSING", "StagedPartMissing", "stage", "staged_batches", "staged_files", "part_file",
           "shard_rows", "write_partition"]

#: Starts the message of :class:`StagedPartMissing`: the driver reads the rows through Spark's shuffle instead.
STAGED_MISSING = "the staged rows of this fit are not readable here"
_POSITION_SHIFT = 33  # monotonically_increasing_id: the partition index above the row's 33 bits
_RESULT = pa.schema([("partition", pa.int64()), ("rows", pa.int64())])


class StagedPartMissing(InputDataError):
    """A rank cannot read a staged file as the staging job wrote it (gone, or on another
    host); the driver then reads the rows through Spark's shuffle."""


def part_file(directory: str, partition: int, shard: int) -> str:
    """The Arrow IPC file of the rows of input partition ``partition`` in logical partition ``shard``."""
    return os.path.join(directory, f"part-{partition:05d}-{shard:05d}.arrow")


def stage(frame: DataFrame, shards: int, directory: str, run: Callable[[DataFrame], pa.Table]) -> StagedRows:
    """Deals the rows of ``frame`` (the training columns in the DataFrame's own partitions)
    out to ``shards`` logical partitions, in files under ``directory``, through the job
    ``run`` runs; what was written.

    Raises:
        InvalidInputError: Spark ran no task: it proved the DataFrame empty.
    """
    table = run(frame.mapInArrow(_writer(directory, shards), "partition long, rows long"))
    written = dict(zip(table.column("partition").to_pylist(), table.column("rows").to_pylist(), strict=True))
    if not written:
        raise InvalidInputError("the training DataFrame has no rows (Spark ran no task to read it)")
    parts = tuple((p, written.get(p, 0)) for p in range(max(written) + 1))  # a partition Spark left out is empty
    return StagedRows(directory, parts)


def _writer(directory: str, shards: int) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The staging job's function: writes its partition (see :func:`write_partition`) and
    returns one row, the partition and its rows."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is None:
            raise RuntimeError("the staging job's function runs in a Spark task")
        partition = context.partitionId()
        rows = write_partition(directory, shards, partition, batches)
        yield pa.RecordBatch.from_arrays([from_numpy([partition]), from_numpy([rows])], schema=_RESULT)

    return write


def write_partition(directory: str, shards: int, partition: int, batches: Iterator[pa.RecordBatch]) -> int:
    """Deals the batches of input partition ``partition`` out to a file per logical
    partition (none when there are no batches), each the writer's own until renamed into
    place once whole (a task Spark retries writes the same rows again); how many rows."""
    attempt = uuid.uuid4().hex
    temporary = [f"{part_file(directory, partition, shard)}.tmp-{attempt}" for shard in range(shards)]
    writers: list[pa.ipc.RecordBatchFileWriter] = []
    rows = 0
    try:
        for batch in batches:
            if not writers:
                writers = [pa.ipc.new_file(path, batch.schema) for path in temporary]
            for shard, rows_of_shard in enumerate(_deal(batch, partition, rows, shards)):
                if rows_of_shard is not None:
                    writers[shard].write_batch(rows_of_shard)
            rows += batch.num_rows
        while writers:  # each closed once: closing again would write another footer
            writers.pop().close()
        if rows:
            for shard, path in enumerate(temporary):
                os.replace(path, part_file(directory, partition, shard))
    finally:
        for writer in writers:  # an error came first: it is the one reported
            with contextlib.suppress(Exception):
                writer.close()
        for path in temporary:  # those not renamed into place
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return rows


def _deal(batch: pa.RecordBatch, partition: int, seen: int, shards: int) -> list[pa.RecordBatch | None]:
    """``batch``'s rows of each logical partition (None: none), its first row the
    ``seen``-th of input partition ``partition``."""
    if shards == 1:
        return [batch]
    first = (partition << _POSITION_SHIFT) + seen  # the position of the batch's first row
    starts = [(shard - first) % shards for shard in range(shards)]  # the batch's first row of each shard
    return [_every(batch, start, shards) if start < batch.num_rows else None for start in starts]


def _every(batch: pa.RecordBatch, start: int, step: int) -> pa.RecordBatch:
    """Rows ``start``, ``start + step``, ... of ``batch``, as Arrow's ``take`` gives them:
    numbers, and arrays of numbers all of one length, without nulls, copied with a stride
    (several times faster than ``take``); other columns through ``take``."""
    indices = None
    columns = []
    for column in batch.columns:
        strided = _strided(column, start, step)
        if strided is None:
            if indices is None:
                indices = from_numpy(np.arange(start, batch.num_rows, step, dtype=np.int64))
            strided = column.take(indices)
        columns.append(strided)
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def _strided(column: pa.Array, start: int, step: int) -> pa.Array | None:
    """:func:`_every`'s rows of one column, or None where it takes them with ``take``."""
    kind = column.type
    if column.null_count:
        return None
    if _numbers(kind):
        values = np.ascontiguousarray(to_numpy(column)[start::step])
        return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not _numbers(kind.value_type):
        return None
    flat = column.flatten()
    offsets = to_numpy(column.offsets)
    width = int(offsets[1] - offsets[0]) if len(column) else 0
    if width == 0 or flat.null_count or not (np.diff(offsets) == width).all():
        return None
    rows = to_numpy(flat).reshape(len(column), width)[start::step]
    values = np.ascontiguousarray(rows).reshape(-1)
    child = pa.Array.from_buffers(flat.type, len(values), [None, pa.py_buffer(values)])
    offsets = np.arange(0, (len(rows) + 1) * width, width, dtype=offsets.dtype)
    return pa.Array.from_buffers(kind, len(rows), [None, pa.py_buffer(offsets)], children=[child])


def _numbers(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def shard_rows(partition: int, rows: int, shard: int, shards: int) -> int:
    """How many of the ``rows`` rows of input partition ``partition`` logical partition ``shard`` holds."""
    start = (shard - (partition << _POSITION_SHIFT)) % shards
    return max(0, -(-(rows - start) // shards))


def staged_files(staged: StagedRows, shard: int, shards: int) -> list[tuple[str, int]]:
    """The files of logical partition ``shard`` of ``shards``, in order (its file of every
    input partition with rows there), each with the rows the staging job wrote to it."""
    return [(part_file(staged.directory, partition, shard), expected) for partition, rows in staged.parts
            if (expected := shard_rows(partition, rows, shard, shards))]


def staged_batches(staged: StagedRows, shard: int, shards: int) -> Iterator[pa.RecordBatch]:
    """The rows of logical partition ``shard`` of ``shards``, in order: its file of every
    input partition in turn (:func:`staged_files`).

    Raises:
        StagedPartMissing: A file is gone, or holds other rows than the staging job wrote.
    """
    for path, expected in staged_files(staged, shard, shards):
        try:
            source = pa.OSFile(path)  # read a batch at a time into memory, not mapped
            reader = pa.ipc.open_file(source)
        except (OSError, pa.ArrowInvalid) as error:
            raise StagedPartMissing(f"{STAGED_MISSING} ({path}: {error})") from None
        seen = 0
        with source:
            for index in range(reader.num_record_batches):
                batch = reader.get_batch(index)
                seen += batch.num_rows
                yield batch
        if seen != expected:
            raise StagedPartMissing(f"{STAGED_MISSING} ({path} holds {seen} rows, the staging job wrote {expected})")
