"""The MLP workloads' data: written once to Parquet, read by every contender.

Rows are ``features: array<float>`` (``Workload.features`` values) and ``label: float``
(a fixed linear function of the features plus noise). The reference workload's table
(:func:`write_parquet`) is one file per rank with equal rows, so Spark reads
``Workload.ranks`` equal partitions and every contender trains on the same number of rows
per rank. (One file with several row groups would give Spark two unequal partitions,
125k and 75k rows, and ``TorchEstimator``'s Spark path, which then keeps all ranks
stepping together, would train 25% more samples per epoch than the others.) The ingest
workload's table (:func:`write_table_file`) is one file of large row groups, written a
row group at a time, as a table often is. Pickled by value (see :mod:`benchmarks.remote`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

if TYPE_CHECKING:
    from benchmarks.workload import IngestWorkload, Workload

__all__ = ["write_parquet", "write_table_file", "write_rank_files", "settle", "list_array", "read_numpy", "read_shard",
           "rank_bounds", "column_values"]

_SCHEMA = pa.schema([("features", pa.list_(pa.float32())), ("label", pa.float32())])


def write_parquet(workload: Workload, directory: str) -> str:
    """Writes ``<directory>/data/part-<rank>.parquet``; returns the ``data`` directory."""
    rng = np.random.default_rng(workload.seed)
    x = rng.standard_normal((workload.rows, workload.features), dtype=np.float32)
    w = rng.standard_normal(workload.features, dtype=np.float32) / np.sqrt(workload.features)
    y = (x @ w + 0.1 * rng.standard_normal(workload.rows, dtype=np.float32)).astype(np.float32)
    return write_rank_files(_table(x, y), os.path.join(directory, "data"), workload.ranks)


def write_rank_files(table: pa.Table, path: str, ranks: int) -> str:
    """Writes ``<path>/part-<rank>.parquet``, one file of equal rows per rank; returns ``path``."""
    os.makedirs(path)
    for rank in range(ranks):
        start, stop = rank_bounds(table.num_rows, rank, ranks)
        pq.write_table(table.slice(start, stop - start), os.path.join(path, f"part-{rank}.parquet"))
    settle(path)
    return path


def write_table_file(workload: IngestWorkload, directory: str) -> str:
    """Writes ``<directory>/table/part-0.parquet``, ``workload.row_group_rows`` rows per
    row group, generating one row group at a time; returns the ``table`` directory."""
    path = os.path.join(directory, "table")
    os.makedirs(path)
    rng = np.random.default_rng(workload.seed)
    w = rng.standard_normal(workload.features, dtype=np.float32) / np.sqrt(workload.features)
    with pq.ParquetWriter(os.path.join(path, "part-0.parquet"), _SCHEMA) as writer:
        for x, noise in _chunks(rng, workload.rows, workload.row_group_rows, workload.features):
            writer.write_table(_table(x, (x @ w + 0.1 * noise).astype(np.float32)),
                               row_group_size=workload.row_group_rows)
    settle(path)
    return path


def settle(path: str) -> None:
    """Flushes every file under ``path`` to disk, so that the kernel does not write up to a
    GB back while the first contender runs."""
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as handle:
            os.fsync(handle.fileno())


def _chunks(rng: np.random.Generator, rows: int, chunk_rows: int,
            width: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for start in range(0, rows, chunk_rows):
        count = min(chunk_rows, rows - start)
        yield rng.standard_normal((count, width), dtype=np.float32), rng.standard_normal(count, dtype=np.float32)


def _table(x: np.ndarray, y: np.ndarray) -> pa.Table:
    return pa.table({"features": list_array(x), "label": pa.array(y)}, schema=_SCHEMA)


def list_array(rows: np.ndarray) -> pa.ListArray:
    """A 2-d array as an Arrow list column (Parquet ``array<...>``), one list per row."""
    offsets = pa.array(np.arange(len(rows) + 1, dtype=np.int32) * rows.shape[1])
    return pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))


def rank_bounds(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of rank ``rank``'s contiguous share, as ``TorchEstimator``'s
    direct read splits a table."""
    return rank * rows // world_size, (rank + 1) * rows // world_size


def read_numpy(path: str, pre_buffer: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """All rows (of a file or a directory of files) as writable
    ``(features (n, d) float32, labels (n,) float32)``: ``pq.read_table`` and one copy of
    each column into a contiguous array, as a ``train_fn`` would do before ``torch.from_numpy``.
    ``pre_buffer`` is ``read_table``'s (its default, True, reads whole column chunks
    before decoding them: on local files here that costs 2-7x the time of False)."""
    table = pq.read_table(path, pre_buffer=pre_buffer)
    return column_values(table, "features").reshape(table.num_rows, -1), column_values(table, "label")


def column_values(table: pa.Table, name: str) -> np.ndarray:
    """A column's values (an array column's flattened), copied once into one writable array."""
    chunks = table.column(name).chunks
    return np.concatenate([chunk.flatten().to_numpy() if pa.types.is_list(chunk.type) else chunk.to_numpy()
                           for chunk in chunks])


def read_shard(path: str, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s contiguous share of the rows as tensors; labels shaped ``(n, 1)``."""
    x, y = read_numpy(path)
    start, stop = rank_bounds(len(x), rank, world_size)
    return torch.from_numpy(x[start:stop]), torch.from_numpy(y[start:stop]).unsqueeze(1)
