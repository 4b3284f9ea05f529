"""[executor] A part of a Parquet table, read with pyarrow as the batches Spark would send.

See :mod:`spark_torch_est.ingest.parquet_plan` for when the tasks read the files themselves. A rank's
batches carry the same columns the Spark job would (see :mod:`spark_torch_est.core.protocol`),
so everything after ingest is the same on both paths; scoring tasks get the table's own
columns, as ``mapInArrow`` would give them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import BinaryIO

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from spark_torch_est.core.arrow import from_numpy
from spark_torch_est.core.file_identity import file_stamp, footer_digest
from spark_torch_est.core.spec import FileSource, How
from spark_torch_est.errors import InputDataError
from spark_torch_est.ingest.tables import stack_columns

__all__ = ["read_part", "over_parts"]

_BATCH_ROWS = 16_384
#: Most uncompressed bytes of one batch read from a file: wide rows come fewer at a time.
_BATCH_BYTES = 4 * 2 ** 20
_PROBE_ROWS = 16  # rows read to measure a row's size


def read_part(source: FileSource, rank: int, batch_rows: int = _BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """The rows of ``rank``'s part, at most ``batch_rows`` (and about ``_BATCH_BYTES``) at a
    time, as training-frame batches.

    Raises:
        InputDataError: A file is no longer as the driver planned it (its size or footer changed).
    """
    columns = list(dict.fromkeys(name for _, sources, _ in source.outputs for name in sources))
    planned = {path: (size, times, digest) for path, size, times, digest in source.files}
    checked: set[str] = set()
    for part in source.parts[rank]:
        fs, path = fsspec.core.url_to_fs(part.path)
        with fs.open(path, "rb") as handle:
            if part.path in planned and part.path not in checked:
                _check_unchanged(part.path, fs, path, handle, *planned[part.path])
                checked.add(part.path)
            reader = pq.ParquetFile(handle, buffer_size=1 << 20, pre_buffer=False)  # stream pages, not whole chunks
            rows = _batch_rows(reader, part.row_group, columns, batch_rows)
            first = 0  # row of the group the next batch starts at
            for batch in reader.iter_batches(batch_size=rows, row_groups=[part.row_group], columns=columns,
                                             use_threads=False):
                start, stop = max(part.start - first, 0), min(part.stop - first, batch.num_rows)
                first += batch.num_rows
                if start < stop:
                    yield _frame(batch.slice(start, stop - start), source)
                if first >= part.stop:
                    break


def _batch_rows(reader: pq.ParquetFile, group: int, columns: list[str], limit: int) -> int:
    """Rows per batch so that one batch is about ``_BATCH_BYTES`` (at most ``limit``), from
    the first rows' size in memory: a footer's sizes are of encoded data, which for
    repetitive values says nothing of the rows' size once read."""
    probe = next(reader.iter_batches(batch_size=min(limit, _PROBE_ROWS), row_groups=[group], columns=columns,
                                     use_threads=False), None)
    if probe is None or not probe.num_rows:
        return limit
    return max(1, min(limit, _BATCH_BYTES * probe.num_rows // max(probe.nbytes, 1)))


def _check_unchanged(url: str, fs: fsspec.AbstractFileSystem, path: str, handle: BinaryIO, planned_size: int,
                     planned_times: str, planned_digest: str) -> None:
    size, times = file_stamp(fs, path)
    if (size, times) == (planned_size, planned_times):
        try:
            if footer_digest(handle, size) == planned_digest:
                return
        except ValueError:
            pass  # reported below, as any other change
    raise InputDataError(
        f"{url} changed after the fit planned its read (size {planned_size} -> {size} bytes, times "
        f"{planned_times} -> {times}, or its footer): fit again to train on the table as it is now, or set "
        "directRead=False to read it through Spark")


def over_parts(source: FileSource, task: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
               ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function over ``spark.range(0, rows, 1, parts)`` that runs ``task``
    over the part of the table whose rows the partition's ids number (a part's first row
    is its partition's first id; see ``sources._split``)."""
    starts = np.cumsum((0,) + source.part_rows[:-1]).tolist()

    def run(ids: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        first = next((batch.column(0)[0].as_py() for batch in ids if batch.num_rows), None)
        if first is None:  # an empty partition
            return
        part = bisect.bisect_right(starts, first) - 1
        if starts[part] != first:
            raise RuntimeError(f"row {first} does not start a part of the table (parts start at {starts})")
        yield from task(read_part(source, part))
        for _ in ids:  # the rest of the partition's ids
            pass

    return run


def _frame(batch: pa.RecordBatch, source: FileSource) -> pa.RecordBatch:
    arrays, names = [], []
    for name, sources, how in source.outputs:
        if how is How.STACK:
            values = stack_columns([batch.column(s) for s in sources], sources)
            array = pa.FixedSizeListArray.from_arrays(from_numpy(values.reshape(-1)), len(sources))
        elif how is How.WRAP:
            array = pa.FixedSizeListArray.from_arrays(batch.column(sources[0]), 1)
        else:
            array = batch.column(sources[0])
        arrays.append(array)
        names.append(name)
    return pa.RecordBatch.from_arrays(arrays, names)
