"""The benchmark data: written once to Parquet, read by every contender.

Rows are ``features: array<float>`` (``Workload.features`` values) and ``label: float``
(a fixed linear function of the features plus noise), in one file per rank with equal
rows, so Spark reads ``Workload.ranks`` equal partitions and every contender trains on
the same number of rows per rank. (One file with several row groups would give Spark two
unequal partitions, 125k and 75k rows, and ``TorchEstimator``, which then keeps all ranks
stepping together, would train 25% more samples per epoch than the others.)
Pickled by value (see :mod:`benchmarks.remote`).
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from benchmarks.workload import Workload

__all__ = ["write_parquet", "read_numpy", "read_shard"]


def write_parquet(workload: Workload, directory: str) -> str:
    """Writes ``<directory>/data/part-<rank>.parquet``; returns the ``data`` directory."""
    rng = np.random.default_rng(workload.seed)
    x = rng.standard_normal((workload.rows, workload.features), dtype=np.float32)
    w = rng.standard_normal(workload.features, dtype=np.float32) / np.sqrt(workload.features)
    y = (x @ w + 0.1 * rng.standard_normal(workload.rows, dtype=np.float32)).astype(np.float32)
    offsets = pa.array(np.arange(workload.rows + 1, dtype=np.int32) * workload.features)
    table = pa.table({
        "features": pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1))),
        "label": pa.array(y),
    })
    path = os.path.join(directory, "data")
    os.makedirs(path)
    for rank in range(workload.ranks):
        start, stop = _bounds(workload.rows, rank, workload.ranks)
        pq.write_table(table.slice(start, stop - start), os.path.join(path, f"part-{rank}.parquet"))
    return path


def _bounds(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    return rank * rows // world_size, (rank + 1) * rows // world_size


def read_numpy(path: str) -> tuple[np.ndarray, np.ndarray]:
    """All rows (of a file or a directory of files) as writable
    ``(features (n, d) float32, labels (n,) float32)``."""
    table = pq.read_table(path)
    column = table.column("features").combine_chunks()
    width = len(column[0])
    x = column.flatten().to_numpy().reshape(len(column), width)
    y = table.column("label").to_numpy()
    return np.array(x, dtype=np.float32), np.array(y, dtype=np.float32)  # writable copies


def read_shard(path: str, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s contiguous share of the rows as tensors; labels shaped ``(n, 1)``."""
    x, y = read_numpy(path)
    start, stop = _bounds(len(x), rank, world_size)
    return torch.from_numpy(x[start:stop]), torch.from_numpy(y[start:stop]).unsqueeze(1)
