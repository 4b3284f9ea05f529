"""[executor] The rows of a partition in RAM, or past a memory budget in local files.

While a partition's feature rows fit the budget they become one contiguous tensor.
Past it, feature rows are written to a file under Spark's local directories and read
back per batch with ``pread``: only the rows of the current batch enter the rank's
memory, so its peak RSS stays near the budget however large the partition. (Memory-
mapping the file does not bound RSS: on current kernels one page fault maps a whole
large folio of the page cache.) Labels are small and always stay in RAM.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

__all__ = ["RowStore", "SpilledRows"]


def _local_dir() -> str:
    """Spark's first local directory in this Python worker, else the temp directory."""
    return os.environ.get("SPARK_LOCAL_DIRS", tempfile.gettempdir()).split(",")[0]


class SpilledRows:
    """A float32 matrix in a local file, indexed like a tensor (integer tensors or slices).

    Args:
        file: The open file holding ``rows * width`` float32 values, row after row.
        rows: Number of rows.
        width: Values per row.
    """

    def __init__(self, file, rows: int, width: int) -> None:
        self._file = file
        self._row_bytes = width * 4
        self.shape = torch.Size((rows, width))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: slice | torch.Tensor) -> torch.Tensor:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("spilled rows support slices with step 1 only")
            out = np.empty((max(stop - start, 0), self.shape[1]), dtype=np.float32)
            os.preadv(self._file.fileno(), [memoryview(out).cast("B")], start * self._row_bytes)
            return torch.from_numpy(out)
        positions = index.tolist()
        out = np.empty((len(positions), self.shape[1]), dtype=np.float32)
        view, size, read = memoryview(out).cast("B"), self._row_bytes, os.preadv
        descriptor = self._file.fileno()
        for i, row in enumerate(positions):
            read(descriptor, [view[i * size:(i + 1) * size]], row * size)
        return torch.from_numpy(out)

    def head(self, rows: int) -> SpilledRows:
        """The first ``rows`` rows, in the same file (extending them overwrites the rows after)."""
        return SpilledRows(self._file, rows, self.shape[1])

    def extend(self, rows: torch.Tensor) -> SpilledRows:
        """Appends rows to the file; returns self."""
        data = rows.to(torch.float32).contiguous().numpy()
        os.pwrite(self._file.fileno(), data.tobytes(), len(self) * self._row_bytes)
        self.shape = torch.Size((len(self) + len(rows), self.shape[1]))
        return self


class RowStore:
    """Columns of one partition; the spillable ones share a memory budget.

    Args:
        budget_bytes: Bytes of spillable rows kept in RAM before they go to files (None:
            never); the files go to Spark's local directory.
    """

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes = budget_bytes
        self.directory = _local_dir()
        self.parts: dict[str, list[np.ndarray]] = {}
        self.files: dict[str, tuple[object, int]] = {}  # name -> (file, rows)
        self.spillable: set[str] = set()
        self.bytes = 0
        self.spilled = False

    def append(self, name: str, values: np.ndarray, spillable: bool = False) -> None:
        """Appends rows to a column (float32 rows when ``spillable``)."""
        self.parts.setdefault(name, [])
        if not spillable:
            self.parts[name].append(values)
            return
        self.spillable.add(name)
        values = values.astype(np.float32, copy=False)
        if self.spilled:
            self._write(name, values)
            return
        self.parts[name].append(values)
        self.bytes += values.nbytes
        if self.budget_bytes is not None and self.bytes > self.budget_bytes:
            self.spilled = True
            for spill in self.spillable:
                for part in self.parts.pop(spill):
                    self._write(spill, part)

    def _write(self, name: str, values: np.ndarray) -> None:
        file, rows = self.files.get(name) or (tempfile.TemporaryFile(dir=self.directory, prefix="spark_torch_est-"), 0)
        file.write(np.ascontiguousarray(values).tobytes())
        self.files[name] = (file, rows + len(values))
        self._width = values.shape[1]

    def column(self, name: str) -> torch.Tensor | SpilledRows | None:
        """The whole column: one tensor, :class:`SpilledRows` when it was spilled, or
        None when it has no rows."""
        if name in self.files:
            file, rows = self.files[name]
            file.flush()
            return SpilledRows(file, rows, self._width)
        parts = [part for part in self.parts.get(name, []) if len(part)]
        return torch.from_numpy(np.concatenate(parts)) if parts else None
