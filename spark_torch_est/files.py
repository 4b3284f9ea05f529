"""[executor] A part of a Parquet table, read with pyarrow as the batches Spark would send.

See :mod:`spark_torch_est.sources` for when the tasks read the files themselves. A rank's
batches carry the same columns the Spark job would (see :mod:`spark_torch_est.protocol`),
so everything after ingest is the same on both paths; scoring tasks get the table's own
columns, as ``mapInArrow`` would give them.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from spark_torch_est.data import arrow_values
from spark_torch_est.spec import FileSource

__all__ = ["read_part", "over_parts"]

_BATCH_ROWS = 16_384


def read_part(source: FileSource, rank: int, batch_rows: int = _BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """The rows of ``rank``'s part, ``batch_rows`` at a time, as training-frame batches."""
    columns = list(dict.fromkeys(name for _, sources, _ in source.outputs for name in sources))
    for part in source.parts[rank]:
        fs, path = fsspec.core.url_to_fs(part.path)
        with fs.open(path, "rb") as handle:
            reader = pq.ParquetFile(handle, buffer_size=1 << 20, pre_buffer=False)  # stream pages, not whole chunks
            first = 0  # row of the group the next batch starts at
            for batch in reader.iter_batches(batch_size=batch_rows, row_groups=[part.row_group], columns=columns,
                                             use_threads=False):
                start, stop = max(part.start - first, 0), min(part.stop - first, batch.num_rows)
                first += batch.num_rows
                if start < stop:
                    yield _frame(batch.slice(start, stop - start), source)
                if first >= part.stop:
                    break


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
        if how == "stack":
            values = np.stack([arrow_values(batch.column(s), s)[0].astype(np.float32, copy=False) for s in sources], 1)
            array = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), len(sources))
        elif how == "wrap":
            array = pa.FixedSizeListArray.from_arrays(batch.column(sources[0]), 1)
        else:
            array = batch.column(sources[0])
        arrays.append(array)
        names.append(name)
    return pa.RecordBatch.from_arrays(arrays, names)
