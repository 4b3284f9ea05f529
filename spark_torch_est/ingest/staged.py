"""[both] The staged rows: a first fit through Spark on one host reads its DataFrame without a shuffle.

The training frame of a fit through Spark deals its rows out to the run's logical
partitions by their positions (:func:`spark_torch_est.ingest.frames.training_frame`): the
row ``k`` of input partition ``p`` has position ``o = p * 2**33 + k`` (what
``monotonically_increasing_id`` numbers it), logical partition ``o mod L`` holds it, in the
order of ``o``. A Spark shuffle moves every row to its partition: its map stage, its fetch
and the sort each cost about as much as Spark's own scan of the rows.

Where every executor runs on the driver's host (local mode, one machine), the rows take
another way there, to the same partitions in the same order:

1. a plain (not barrier) job over the DataFrame's own partitions writes each partition's
   Arrow batches, as Spark hands them to Python, to one Arrow IPC file in a folder of the
   fit (:func:`stage`), about the cost of Spark's scan;
2. each rank of the training job reads every file and keeps the rows of its logical
   partition (:func:`staged_batches`), which is what the shuffle would have brought it.

The ranks' rows are thus those of the shuffle, bitwise, so a run may go on either way
(a relaunch, a later fit, a cluster of several hosts). A file that is gone or not as the
job wrote it (a rank on another host than the writer) stops the job before training, and
the fit reads through the shuffle instead (:data:`STAGED_MISSING`). The driver removes
the folder when the fit ends.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from spark_torch_est.core.spec import StagedRows
from spark_torch_est.errors import InputDataError, InvalidInputError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["STAGED_MISSING", "StagedPartMissing", "stage", "staged_batches", "part_file"]

#: Starts the message of :class:`StagedPartMissing`: the driver reads the rows through Spark's shuffle instead.
STAGED_MISSING = "the staged rows of this fit are not readable here"
_POSITION_SHIFT = 33  # monotonically_increasing_id: the partition index above the row's 33 bits
_RESULT = pa.schema([("partition", pa.int64()), ("rows", pa.int64())])


class StagedPartMissing(InputDataError):
    """A rank cannot read a staged file as the staging job wrote it (gone, or on another
    host); the driver then reads the rows through Spark's shuffle."""


def part_file(directory: str, partition: int) -> str:
    """The Arrow IPC file of input partition ``partition``."""
    return os.path.join(directory, f"part-{partition:05d}.arrow")


def stage(frame: DataFrame, directory: str, run: Callable[[DataFrame], pa.Table]) -> StagedRows:
    """Writes the rows of ``frame`` (the training columns in the DataFrame's own partitions)
    to one file per partition under ``directory`` through the job ``run`` runs; what was
    written.

    Raises:
        InvalidInputError: Spark ran no task: it proved the DataFrame empty.
    """
    table = run(frame.mapInArrow(_writer(directory), "partition long, rows long"))
    written = dict(zip(table.column("partition").to_pylist(), table.column("rows").to_pylist(), strict=True))
    if not written:
        raise InvalidInputError("the training DataFrame has no rows (Spark ran no task to read it)")
    parts = tuple((p, written.get(p, 0)) for p in range(max(written) + 1))  # a partition Spark left out is empty
    return StagedRows(directory, parts)


def _writer(directory: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The staging job's function: writes its partition's batches to a file of its own,
    renamed into place once whole (a task Spark retries writes the same rows again)."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is None:
            raise RuntimeError("the staging job's function runs in a Spark task")
        partition = context.partitionId()
        path = part_file(directory, partition)
        temporary = f"{path}.tmp-{uuid.uuid4().hex}"
        rows = 0
        writer: pa.ipc.RecordBatchFileWriter | None = None
        try:
            for batch in batches:
                if writer is None:
                    writer = pa.ipc.new_file(temporary, batch.schema)
                writer.write_batch(batch)
                rows += batch.num_rows
            if writer is not None:
                writer.close()
                writer = None
                os.replace(temporary, path)
        finally:
            if writer is not None:
                writer.close()
            if os.path.exists(temporary):
                os.remove(temporary)
        yield pa.RecordBatch.from_arrays([pa.array([partition], pa.int64()), pa.array([rows], pa.int64())],
                                         schema=_RESULT)

    return write


def staged_batches(staged: StagedRows, shard: int, shards: int) -> Iterator[pa.RecordBatch]:
    """The rows of logical partition ``shard`` of ``shards``, in order: from every staged
    file in turn, the rows whose position is ``shard`` modulo ``shards``.

    Raises:
        StagedPartMissing: A file is gone, or holds other rows than the staging job wrote.
    """
    for partition, rows in staged.parts:
        if rows == 0:
            continue
        path = part_file(staged.directory, partition)
        try:
            reader = pa.ipc.open_file(pa.OSFile(path))  # read a batch at a time into memory, not mapped
        except (OSError, pa.ArrowInvalid) as error:
            raise StagedPartMissing(f"{STAGED_MISSING} ({path}: {error})") from None
        first = partition << _POSITION_SHIFT  # the position of the partition's first row
        seen = 0
        for index in range(reader.num_record_batches):
            batch = reader.get_batch(index)
            start = (shard - (first + seen)) % shards  # the batch's first row of this shard
            if shards == 1:
                yield batch
            elif start < batch.num_rows:
                yield batch.take(pa.array(np.arange(start, batch.num_rows, shards, dtype=np.int64)))
            seen += batch.num_rows
        if seen != rows:
            raise StagedPartMissing(f"{STAGED_MISSING} ({path} holds {seen} rows, the staging job wrote {rows})")
