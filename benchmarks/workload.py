"""The benchmark workloads of the MLP: their sizes, and the model and optimizer every
contender builds.

:class:`Workload` is the reference workload; :class:`IngestWorkload` is the same MLP on a
large table, for the ingest figures. Every workload (see also
:mod:`benchmarks.recommender`) tells the plain contenders how to build its model
(``build``), its loss (``loss_fn``) and a rank's tensors (``read_rank``), and travels to
contender processes as JSON (``to_json``; :func:`benchmarks.protocol.load_workload` reads
it back by its ``kind``).

This module is pickled by value (see :mod:`benchmarks.remote`): Spark executors and
torchrun workers run its creators without ``benchmarks`` on their path.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from benchmarks.dataset import read_shard

__all__ = ["WorkloadBase", "Workload", "IngestWorkload", "make_model", "make_big_model", "make_optimizer"]


class WorkloadBase:
    """What every workload dataclass shares: its ``kind``, its JSON form, and how the seeded
    model and its optimizer are built (from its ``seed`` and ``config``)."""

    kind: ClassVar[str] = ""

    def describe(self) -> str:
        """One line for the report: what the workload is."""
        raise NotImplementedError

    def new_model(self) -> nn.Module:
        """A new model of the workload (the creator every contender calls)."""
        raise NotImplementedError

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The seeded model and its optimizer, as every contender builds them."""
        torch.manual_seed(self.seed)
        model = self.new_model()
        return model, make_optimizer(model, self.config)

    def to_json(self) -> str:
        """The workload as one JSON string with its ``kind`` (passed to contender subprocesses)."""
        return json.dumps({"kind": self.kind, **dataclasses.asdict(self)})

    @classmethod
    def from_json(cls, text: str):
        """Reads what :meth:`to_json` wrote."""
        fields = json.loads(text)
        fields.pop("kind", None)
        return cls(**fields)


@dataclass(frozen=True)
class Workload(WorkloadBase):
    """One benchmark's sizes, identical for every contender.

    Attributes:
        rows: Training rows (default 200k).
        features: Float32 features per row (default 32).
        hidden: Width of both hidden layers of the MLP (default 256).
        epochs: Epochs every training contender runs (default 3).
        batch_size: Rows per rank per step (default 256).
        ranks: DDP ranks, also the Spark task slots of ``local[ranks]`` (default 2).
        lr: SGD learning rate (default 0.01).
        seed: Seed of the data, the initial weights and the shuffles (default 0).
        big_model_mb: Size of the frozen parameters of the checkpoint-transfer model (default 100).
        checkpoint_steps: Optimizer steps of each checkpoint-transfer fit (default 20).
        path: The Parquet directory every contender reads (set once it is written).
    """

    rows: int = 200_000
    features: int = 32
    hidden: int = 256
    epochs: int = 3
    batch_size: int = 256
    ranks: int = 2
    lr: float = 0.01
    seed: int = 0
    big_model_mb: int = 100
    checkpoint_steps: int = 20
    path: str = ""

    kind: ClassVar[str] = "mlp"

    @classmethod
    def quick(cls) -> Workload:
        """A smoke-test size: 20k rows, 1 epoch."""
        return cls(rows=20_000, epochs=1)

    @property
    def config(self) -> dict:
        """The creators' ``config`` dict."""
        return {"features": self.features, "hidden": self.hidden, "lr": self.lr, "big_model_mb": self.big_model_mb}

    def describe(self) -> str:
        """One line for the report: what the workload is."""
        return (f"Reference: {self.rows:,} rows x {self.features} float32 features (Parquet, one file per rank), "
                f"{self._mlp()}, {self.epochs} epoch(s).")

    def _mlp(self) -> str:
        return (f"MLP {self.features}-{self.hidden}-{self.hidden}-1, SGD lr {self.lr}, batch {self.batch_size} per "
                f"rank, {self.ranks} ranks x 1 thread, local[{self.ranks}]")

    def new_model(self) -> nn.Module:
        """The MLP."""
        return make_model(self.config)

    def loss_fn(self) -> nn.Module:
        """Mean squared error."""
        return nn.MSELoss()

    def read_rank(self, rank: int, world_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Rank ``rank``'s contiguous share of the rows: ``((features,), labels)``."""
        features, labels = read_shard(self.path, rank, world_size)
        return (features,), labels


@dataclass(frozen=True)
class IngestWorkload(Workload):
    """The reference MLP on a table large enough to time ingest: 4M rows in one Parquet
    file of 1M-row row groups (~530 MB), so Spark's default 128 MB splits read it as
    several partitions. Its fits are short: ``steps`` optimizer steps after the ingest.

    Attributes:
        row_group_rows: Rows per Parquet row group (default 1,000,000).
        steps: Optimizer steps of each timed fit (default 20).
    """

    rows: int = 4_000_000
    epochs: int = 1
    row_group_rows: int = 1_000_000
    steps: int = 20

    kind: ClassVar[str] = "ingest"

    @classmethod
    def quick(cls) -> IngestWorkload:
        """A smoke-test size: 200k rows in row groups of 50k."""
        return cls(rows=200_000, row_group_rows=50_000)

    def describe(self, rows: str | None = None) -> str:
        """One line for the report: what the workload is (``rows`` replaces the row count)."""
        return (f"Ingest: {rows or f'{self.rows:,}'} rows x {self.features} float32 features in one Parquet file of "
                f"{self.row_group_rows:,}-row row groups; {self._mlp()}; fits of {self.steps} steps.")

    @property
    def share_mb(self) -> float:
        """MB (MiB) of one rank's share of the training tensors: features and label, float32."""
        return self.rows / self.ranks * (self.features + 1) * 4 / 2 ** 20


def make_model(config: dict) -> nn.Module:
    """The MLP features-hidden-hidden-1."""
    width = config["hidden"]
    return nn.Sequential(
        nn.Linear(config["features"], width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, 1),
    )


class _WithFrozenBlock(nn.Module):
    """The MLP plus ``big_model_mb`` MB of frozen parameters that only make the checkpoint big."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.mlp = make_model(config)
        floats = config["big_model_mb"] * 1_000_000 // 4
        self.frozen = nn.Parameter(torch.zeros(floats), requires_grad=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.mlp(inputs)


def make_big_model(config: dict) -> nn.Module:
    """The MLP with ``config["big_model_mb"]`` MB of frozen parameters."""
    return _WithFrozenBlock(config)


def make_optimizer(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    """Plain SGD over the trainable parameters."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=config["lr"])

