"""[executor] One column of a rank's table (see :class:`~spark_torch_est.ingest.tables.Table`),
whatever its type and shape: the :data:`Column` types.

A :class:`DenseColumn` keeps rows of one shape in a tensor. Past the memory budget, rows go to
a file under Spark's local directories and :class:`SpilledColumn` reads back only the rows
of each batch, with ``pread``, so a rank's peak RSS stays near the budget however large
its partition. (Memory-mapping the file does not bound RSS: on current kernels one page
fault maps a whole large folio of the page cache.) Both keep the column's own dtype:
bytes stay uint8, ids int64. :class:`RaggedColumn` holds arrays of different lengths as
their values and offsets, and pad each batch to its longest row.

A :class:`ColumnBuilder` collects a column batch by batch; builders that share a
:class:`Budget` spill together once their rows pass it.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import sys
import tempfile
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import torch

__all__ = ["DenseColumn", "SpilledColumn", "RaggedColumn", "Column", "Budget", "ColumnBuilder", "spark_local_dir",
           "spill_file"]

_RELEASE_EVERY = 32 << 20  # bytes of copied batches after which Arrow returns freed memory
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # for madvise


def spark_local_dir() -> str:
    """Spark's first local directory in this Python worker, else the temp directory."""
    return os.environ.get("SPARK_LOCAL_DIRS", tempfile.gettempdir()).split(",")[0]


def spill_file() -> BinaryIO:
    """A new file for rows past the memory budget, under Spark's local directory, deleted
    once closed (the name goes at once; the rank keeps it open)."""
    return tempfile.TemporaryFile(dir=spark_local_dir(), prefix="spark_torch_est-")


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


class DenseColumn:
    """Rows of one shape, in one tensor.

    Args:
        tensor: ``(rows, *row_shape)``.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._released = 0  # where the memory given back ends (see release)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape[1:])

    def __len__(self) -> int:
        return len(self.tensor)

    def take(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows at ``positions``, as one tensor (``index_select``: 5x faster than
        indexing for rows spread over a large column)."""
        return torch.index_select(self.tensor, 0, positions)

    def slice(self, start: int, stop: int) -> torch.Tensor:
        """A copy of rows ``start`` to ``stop`` (a model that changes its input in place
        must not change the rows)."""
        return self.tensor[start:stop].clone()

    def head(self, rows: int) -> DenseColumn:
        """The first ``rows`` rows."""
        return DenseColumn(self.tensor[:rows].contiguous())

    def release(self, stop: int) -> None:
        """Gives the memory of the rows before ``stop`` back to the system (on Linux, the
        whole pages they fill: ``madvise(MADV_DONTNEED)``), for rows nothing reads again:
        they read as zeros after. Nothing happens to rows not held in one block of memory."""
        tensor = self.tensor
        if _LIBC is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return
        first, page = tensor.data_ptr(), mmap.PAGESIZE
        begin = max(-(-first // page) * page, self._released)
        end = (first + min(max(stop, 0), len(tensor)) * (tensor.nbytes // max(len(tensor), 1))) // page * page
        if end > begin:
            _LIBC.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), mmap.MADV_DONTNEED)
            self._released = end

    def extend(self, rows: torch.Tensor) -> DenseColumn:
        """These rows followed by ``rows``."""
        return DenseColumn(torch.cat([self.tensor, rows.to(self.dtype)]))

    def to_ragged(self, padding: float) -> RaggedColumn:
        """The same arrays as :class:`RaggedColumn` (for a column other ranks hold ragged)."""
        width = self.row_shape[0]
        return RaggedColumn(DenseColumn(self.tensor.reshape(-1)), torch.arange(len(self) + 1) * width, padding)


class SpilledColumn:
    """Rows of one shape in a local file, read back per batch.

    Args:
        file: The open file, rows one after the other.
        rows: Number of rows.
        row_shape: Shape of one row.
        dtype: The rows' dtype.
    """

    def __init__(self, file, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._file = file
        self._rows = rows
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self._numpy = _numpy_dtype(dtype)
        self._row_bytes = math.prod(self.row_shape) * self._numpy.itemsize

    def __len__(self) -> int:
        return self._rows

    def take(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows at ``positions``: one ``pread`` per row, nothing else enters memory."""
        out = np.empty((len(positions), *self.row_shape), dtype=self._numpy)
        view, size, descriptor = _bytes_of(out), self._row_bytes, self._file.fileno()
        for i, row in enumerate(positions.tolist()):
            os.preadv(descriptor, [view[i * size:(i + 1) * size]], row * size)
        return torch.from_numpy(out)

    def slice(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start`` to ``stop``, in one read."""
        start, stop = max(start, 0), min(stop, len(self))
        out = np.empty((max(stop - start, 0), *self.row_shape), dtype=self._numpy)
        if out.size:
            os.preadv(self._file.fileno(), [_bytes_of(out)], start * self._row_bytes)
        return torch.from_numpy(out)

    def head(self, rows: int) -> SpilledColumn:
        """The first ``rows`` rows, in the same file (extending them overwrites the rows after)."""
        return SpilledColumn(self._file, rows, self.row_shape, self.dtype)

    def extend(self, rows: torch.Tensor) -> SpilledColumn:
        """These rows followed by ``rows``, written to the file after them (this object is
        left as it is: a worker may keep it for a later fit)."""
        data = rows.to(self.dtype).contiguous().numpy()
        os.pwrite(self._file.fileno(), data.tobytes(), len(self) * self._row_bytes)
        return SpilledColumn(self._file, len(self) + len(rows), self.row_shape, self.dtype)

    def to_ragged(self, padding: float) -> RaggedColumn:
        """The same arrays as :class:`RaggedColumn` over the same file."""
        width = self.row_shape[0]
        values = SpilledColumn(self._file, len(self) * width, (), self.dtype)
        return RaggedColumn(values, torch.arange(len(self) + 1) * width, padding)


class RaggedColumn:
    """Arrays of different lengths: their values one after the other, and offsets.

    Args:
        values: The values of every row, as rows of one value (dense or spilled).
        offsets: ``(rows + 1,)`` int64: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.
        padding: What shorter rows of a batch are padded with.
    """

    row_shape = None

    def __init__(self, values: DenseColumn | SpilledColumn, offsets: torch.Tensor, padding: float = 0) -> None:
        self.values = values
        self.offsets = offsets
        self.padding = padding

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The lengths of rows ``start`` to ``stop``."""
        offsets = self.offsets[start:(len(self) if stop is None else stop) + 1]
        return offsets[1:] - offsets[:-1]

    def take(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows at ``positions`` as ``(B, longest)``, shorter rows padded at the end."""
        starts = self.offsets[positions]
        lengths = self.offsets[positions + 1] - starts
        longest = int(lengths.max()) if len(positions) else 0
        out = torch.full((len(positions), longest), self.padding, dtype=self.dtype)
        if isinstance(self.values, DenseColumn):
            columns = torch.arange(longest)
            mask = columns < lengths.unsqueeze(1)
            out[mask] = self.values.tensor[(starts.unsqueeze(1) + columns)[mask]]
            return out
        for i, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
            out[i, :length] = self.values.slice(start, start + length)
        return out

    def slice(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start`` to ``stop``, padded."""
        return self.take(torch.arange(start, min(stop, len(self))))

    def flat(self, start: int, stop: int) -> torch.Tensor:
        """The values of rows ``start`` to ``stop``, unpadded, one after the other."""
        return self.values.slice(int(self.offsets[start]), int(self.offsets[stop]))

    def head(self, rows: int) -> RaggedColumn:
        """The first ``rows`` rows."""
        return RaggedColumn(self.values.head(int(self.offsets[rows])), self.offsets[:rows + 1].clone(), self.padding)

    def extend_flat(self, values: torch.Tensor, lengths: torch.Tensor) -> RaggedColumn:
        """These rows followed by rows of ``lengths``, whose values are ``values``."""
        offsets = torch.cat([self.offsets, self.offsets[-1] + torch.cumsum(lengths.to(torch.int64), 0)])
        return RaggedColumn(self.values.extend(values), offsets, self.padding)


#: One column of a rank's rows, however it is held.
Column = DenseColumn | SpilledColumn | RaggedColumn


class Budget:
    """Bytes of spillable rows a rank keeps in RAM, shared by its builders.

    Args:
        limit: The bytes; None never spills.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0
        self.exceeded = False
        self.builders: list[ColumnBuilder] = []

    def add(self, nbytes: int) -> None:
        """Counts ``nbytes`` more; past the limit every spillable builder spills."""
        self.used += nbytes
        if self.limit is not None and not self.exceeded and self.used > self.limit:
            self.exceeded = True
            for builder in self.builders:
                builder.spill()


def _bytes_of(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, writable in place (also with no rows, which numpy
    before 2.0 cannot ``cast`` a memoryview of)."""
    return array.reshape(-1).view(np.uint8).data


class GrowingBuffer:
    """Rows of one shape in an anonymous memory map that grows as they come: on Linux a
    map grows by moving its pages (``mremap``), not by copying them, and only the pages a
    row reaches take memory, so each row is copied once, as it arrives. (``ndarray.resize``
    would zero the new part, touching every page.) Elsewhere a larger map is made and the
    rows copied into it.

    Args:
        values: Room for this many values at first.
        inner: Each value's shape.
        dtype: The values' dtype.
    """

    def __init__(self, values: int, inner: tuple[int, ...], dtype: np.dtype) -> None:
        self._inner, self._dtype = inner, np.dtype(dtype)
        self._value_bytes = self._dtype.itemsize * math.prod(inner)
        self._map = mmap.mmap(-1, self._size(values), flags=mmap.MAP_PRIVATE)
        self._huge()
        self.array = self._view(values)

    def grow(self, values: int, fit: bool = False) -> np.ndarray:
        """The array, now with room for at least ``values`` values (twice its room, when that
        is more, so growing costs a constant per value), or exactly ``values`` with ``fit``.
        The caller must hold no view of the array: the map may move."""
        room = values if fit else max(values, 2 * len(self.array))
        del self.array
        try:
            self._map.resize(self._size(room))
        except (OSError, SystemError):  # no mremap here: a new map, and one copy
            larger = mmap.mmap(-1, self._size(room), flags=mmap.MAP_PRIVATE)
            kept = min(len(self._map), len(larger))
            with memoryview(self._map) as old:
                larger[:kept] = old[:kept]
            self._map.close()
            self._map = larger
        self._huge()
        self.array = self._view(room)
        return self.array

    def _huge(self) -> None:
        """Asks Linux for huge pages (2 MB) for the map, as numpy does for its large arrays:
        a page fault per 2 MB instead of per 4 kB as rows arrive (a first fit through Spark
        on 4M rows x 32 floats, 2 ranks: 3.43 s to the first step against 3.98 s)."""
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # a kernel built without them
                self._map.madvise(mmap.MADV_HUGEPAGE)

    def _size(self, values: int) -> int:
        return max(values * self._value_bytes, 1)  # a map cannot be empty

    def _view(self, values: int) -> np.ndarray:
        return np.frombuffer(self._map, dtype=self._dtype, count=values * math.prod(self._inner)) \
            .reshape(values, *self._inner)


class ColumnBuilder:
    """Collects one column of a rank, batch by batch.

    Rows of one size go straight into one buffer, so no batch is kept past its copy: of
    ``capacity`` rows when the rank knows how many it will get (reading a table's files
    itself), whose pages that no row reaches are never touched and take no memory;
    otherwise a :class:`GrowingBuffer`, which doubles as the rows come by moving its pages
    rather than copying them, fitted to the rows at the end. Once rows differ in
    size, the batches are kept and copied into one tensor at the end, each released once
    copied.

    Args:
        dtype: The column's tensor dtype.
        budget: The shared budget of spillable rows, or None to keep this column in RAM.
        capacity: At most how many rows will come, if known.
    """

    def __init__(self, dtype: torch.dtype, budget: Budget | None = None, capacity: int | None = None) -> None:
        self.dtype = dtype
        self._numpy = _numpy_dtype(dtype)
        self.budget = budget
        self.capacity = capacity
        self.parts: list[np.ndarray] = []
        self.arrays: bool | None = None      # rows are arrays (with lengths), not single values
        self.width: int | None = None        # the one length of every array row so far ...
        self.lengths: list[np.ndarray] = []  # ... or, once they differ, every row's length
        self.inner: tuple[int, ...] | None = None
        self.rows = 0
        self.file: BinaryIO | None = None
        self._buffer: np.ndarray | None = None  # the rows' values so far, filled up to _filled
        self._filled = 0
        self._growing: GrowingBuffer | None = None  # the buffer's map, when the capacity is not known
        self._buffering = True  # until rows of another size come
        if budget is not None:
            budget.builders.append(self)

    def append(self, values: np.ndarray, lengths: np.ndarray | None = None,
               inner: tuple[int, ...] = ()) -> None:
        """Appends rows: ``values`` holds one value (or element of ``inner`` shape) per
        row, or, with ``lengths``, every row's values one after the other."""
        if self.inner is None:
            self.inner = tuple(inner)
        values = np.asarray(values).reshape(-1, *self.inner)
        if self.arrays is None:
            self.arrays = lengths is not None
        elif self.arrays != (lengths is not None):
            raise ValueError("a column cannot mix rows with and without lengths")
        if lengths is not None:
            self._count_lengths(np.asarray(lengths, dtype=np.int64))
        self.rows += len(values) if lengths is None else len(lengths)
        if self.file is not None:
            self.file.write(np.ascontiguousarray(values, dtype=self._numpy).tobytes())
            self._written += len(values)
            return
        if not self._buffered(values, lengths):
            self.parts.append(values.astype(self._numpy, copy=False))
        if self.budget is not None:
            self.budget.add(len(values) * self._numpy.itemsize * math.prod(self.inner))

    def _count_lengths(self, lengths: np.ndarray) -> None:
        """Keeps one width while every array row has it; every row's length once not."""
        if self.lengths:
            self.lengths.append(lengths)
        elif len(lengths) and not ((lengths == lengths[0]).all() and self.width in (None, int(lengths[0]))):
            if self.rows:  # the rows so far all had the one width
                self.lengths.append(np.full(self.rows, self.width, dtype=np.int64))
            self.lengths.append(lengths)
        elif len(lengths):
            self.width = int(lengths[0])

    def _buffered(self, values: np.ndarray, lengths: np.ndarray | None) -> bool:
        """Copies ``values`` into the buffer (making it on the first rows, growing it as they
        come when the capacity is not known); False when they cannot go there."""
        if not self._buffering:
            return False
        per_row = 1 if lengths is None else int(lengths[0]) if len(lengths) else 0
        uniform = lengths is None or (lengths == per_row).all()
        if self._buffer is None and uniform:
            inner = self.inner or ()  # append set it before
            if self.capacity is not None:
                self._buffer = np.empty((self.capacity * per_row, *inner), dtype=self._numpy)
            else:
                self._growing = GrowingBuffer(len(values), inner, self._numpy)
                self._buffer = self._growing.array
            self._per_row = per_row
        end = self._filled + len(values)
        if self._buffer is not None and uniform and per_row == self._per_row:
            if end > len(self._buffer) and self._growing is not None:
                self._buffer = None  # the map cannot move while a view of it lives
                self._buffer = self._growing.grow(end)
            if end <= len(self._buffer):
                self._buffer[self._filled:end] = values
                self._filled = end
                return True
        self._buffering = False  # rows of another size, or more than the capacity: batches are kept
        if self._buffer is not None:
            self.parts.append(self._buffer[:self._filled])
            self._buffer, self._growing = None, None
        return False

    def spill(self) -> None:
        """Moves the rows collected so far to a file; later rows go there directly."""
        if self.budget is None or self.file is not None:
            return
        self.file = spill_file()
        self._written = 0
        self._buffering = False
        if self._buffer is not None:
            self.parts.insert(0, self._buffer[:self._filled])
            self._buffer, self._growing = None, None
        for part in self.parts:  # written from where it lies: the buffer may be most of the budget
            self.file.write(_bytes_of(np.ascontiguousarray(part)))
            self._written += len(part)
        self.parts = []

    def finish(self, padding: float = 0) -> Column | None:
        """The column: rows of one shape as :class:`DenseColumn` or :class:`SpilledColumn`,
        rows of different lengths as :class:`RaggedColumn`; None without rows."""
        if self.rows == 0:
            return None
        inner = self.inner or ()
        values = self._values(inner)
        if not self.arrays:
            return values
        if not self.lengths:  # every row has the same length
            width = self.width or 0
            if isinstance(values, DenseColumn):
                return DenseColumn(values.tensor.reshape(self.rows, width, *inner))
            return SpilledColumn(self.file, self.rows, (width, *inner), self.dtype)
        lengths = np.concatenate(self.lengths)
        self.lengths = []
        if inner:
            raise ValueError("arrays of arrays must all have the same sizes")
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
        return RaggedColumn(values, offsets, padding)

    def finish_column(self, padding: float = 0) -> Column:
        """:meth:`finish` for a column that has rows.

        Raises:
            ValueError: No rows came.
        """
        rows = self.finish(padding)
        if rows is None:
            raise ValueError("the column has no rows")
        return rows

    def _values(self, inner: tuple[int, ...]) -> DenseColumn | SpilledColumn:
        """Every value collected, as rows of ``inner`` shape: the buffer (a grown one fitted
        to the rows), or one copy of the kept batches into a tensor, releasing each once
        copied."""
        if self.file is not None:
            self.file.flush()
            return SpilledColumn(self.file, self._written, inner, self.dtype)
        if self._buffer is not None:
            if self._growing is not None:
                self._buffer = None
                self._buffer, self._growing = self._growing.grow(self._filled, fit=True), None
            return DenseColumn(torch.from_numpy(self._buffer[:self._filled]))
        total = sum(len(part) for part in self.parts)
        out = np.empty((total, *inner), dtype=self._numpy)
        position = released = 0
        parts, self.parts = self.parts[::-1], []
        while parts:
            part = parts.pop()  # the list lets go of it, so the Arrow buffer behind it goes ...
            out[position:position + len(part)] = part
            position += len(part)
            released += part.nbytes
            if released > _RELEASE_EVERY:  # ... back to the system, as the copy grows
                pa.default_memory_pool().release_unused()
                released = 0
        return DenseColumn(torch.from_numpy(out))
