"""The recommender workload: int64 ids into embeddings beside dense floats, through ``inputCols``.

The table has ``user`` and ``item`` (int64 ids far above 2**24, as hashed ids are),
``dense`` (one ``array<float>`` of 13 values per row, the dense block of a click log) and
``clicked`` (a float 0/1 label). The model hashes each id into a table of ``buckets``
embeddings, runs the dense block through a small MLP, and scores the concatenation:
``model(user, item, dense)``, as ``TorchEstimator(inputCols=["user", "item", "dense"])``
calls it. Bare DDP trains the same module on the same tensors read with pyarrow.

Pickled by value (see :mod:`benchmarks.remote`): the executors build the model from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from benchmarks.dataset import column_values, list_array, rank_bounds, write_rank_files
from benchmarks.workload import WorkloadBase

__all__ = ["RecWorkload", "RecModel", "make_rec_model", "write_rec_parquet", "read_rec_numpy", "INPUT_COLS",
           "LABEL_COL"]

_ID_BASE = 1 << 40  # every id is above 2**24: exact only as int64
INPUT_COLS = ["user", "item", "dense"]
LABEL_COL = "clicked"


@dataclass(frozen=True)
class RecWorkload(WorkloadBase):
    """The recommender benchmark's sizes, identical for TorchEstimator and bare DDP.

    Attributes:
        rows: Training rows (default 1M).
        dense: Dense float features per row, one ``array<float>`` column (default 13).
        buckets: Embeddings per id table; ids are hashed into them (default 10,000).
        dim: Embedding width (default 16).
        hidden: Width of the MLPs (default 64).
        epochs: Epochs of the timed fit (default 1).
        batch_size: Rows per rank per step (default 256).
        ranks: DDP ranks (default 2).
        lr: SGD learning rate (default 0.05).
        seed: Seed of the data, the initial weights and the shuffles (default 0).
        warmup_steps: Optimizer steps of the short fit that warms the session up (default 50).
        path: The Parquet directory (set once it is written).
    """

    rows: int = 1_000_000
    dense: int = 13
    buckets: int = 10_000
    dim: int = 16
    hidden: int = 64
    epochs: int = 1
    batch_size: int = 256
    ranks: int = 2
    lr: float = 0.05
    seed: int = 0
    warmup_steps: int = 50
    path: str = ""

    kind: ClassVar[str] = "recommender"

    @classmethod
    def quick(cls) -> RecWorkload:
        """A smoke-test size: 50k rows."""
        return cls(rows=50_000, warmup_steps=10)

    def describe(self) -> str:
        """One line for the report: what the workload is."""
        return (f"Recommender: {self.rows:,} rows of `user`, `item` (int64 ids above 2**24), `dense` (one "
                f"array<float> of {self.dense}) and a 0/1 label, `inputCols={INPUT_COLS}`; two embedding tables of "
                f"{self.buckets:,} x {self.dim} (ids hashed into them) + MLPs of {self.hidden}, BCE, SGD lr {self.lr}, "
                f"batch {self.batch_size} per rank, {self.epochs} epoch(s), {self.ranks} ranks x 1 thread.")

    @property
    def config(self) -> dict:
        """The creators' ``config`` dict."""
        return {"dense": self.dense, "buckets": self.buckets, "dim": self.dim, "hidden": self.hidden, "lr": self.lr}

    def new_model(self) -> nn.Module:
        """A :class:`RecModel`."""
        return make_rec_model(self.config)

    def loss_fn(self) -> nn.Module:
        """Binary cross-entropy on the click logit."""
        return nn.BCEWithLogitsLoss()

    def read_rank(self, rank: int, world_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Rank ``rank``'s contiguous share: ``((user, item, dense), clicked (n, 1))``."""
        user, item, dense, clicked = read_rec_numpy(self.path)
        start, stop = rank_bounds(len(user), rank, world_size)
        inputs = tuple(torch.from_numpy(a[start:stop]) for a in (user, item, dense))
        return inputs, torch.from_numpy(clicked[start:stop]).unsqueeze(1)


class RecModel(nn.Module):
    """Two hashed id embeddings and an MLP of the dense block, scored by a small MLP.

    Args:
        config: ``dense``, ``buckets``, ``dim`` and ``hidden`` (see :class:`RecWorkload`).
    """

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.buckets, dim, hidden = config["buckets"], config["dim"], config["hidden"]
        self.users = nn.Embedding(self.buckets, dim)
        self.items = nn.Embedding(self.buckets, dim)
        self.dense = nn.Sequential(nn.Linear(config["dense"], hidden), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(2 * dim + hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, user: torch.Tensor, item: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        embedded = [self.users(user % self.buckets), self.items(item % self.buckets), self.dense(dense)]
        return self.top(torch.cat(embedded, dim=1))


def make_rec_model(config: dict) -> nn.Module:
    """The model creator: a :class:`RecModel`."""
    return RecModel(config)


def write_rec_parquet(workload: RecWorkload, directory: str) -> str:
    """Writes ``<directory>/clicks/part-<rank>.parquet`` (equal rows per file); returns the directory."""
    rng = np.random.default_rng(workload.seed)
    user = _ID_BASE + rng.integers(0, 1 << 30, workload.rows)
    item = _ID_BASE + rng.integers(0, 1 << 20, workload.rows)
    dense = rng.standard_normal((workload.rows, workload.dense), dtype=np.float32)
    w = rng.standard_normal(workload.dense, dtype=np.float32) / np.sqrt(workload.dense)
    logit = dense @ w + 0.5 * np.cos(user % 101) - 0.5 * np.sin(item % 89)
    clicked = (rng.random(workload.rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    table = pa.table({"user": pa.array(user), "item": pa.array(item), "dense": list_array(dense),
                      LABEL_COL: pa.array(clicked)})
    return write_rank_files(table, os.path.join(directory, "clicks"), workload.ranks)


def read_rec_numpy(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All rows as writable ``(user int64, item int64, dense (n, 13) float32, clicked float32)``."""
    table = pq.read_table(path)
    user, item, dense, clicked = (column_values(table, name) for name in (*INPUT_COLS, LABEL_COL))
    return user, item, dense.reshape(table.num_rows, -1), clicked
