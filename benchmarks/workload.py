"""The benchmark workload: its sizes, and the model and optimizer every contender builds.

This module is pickled by value (see :mod:`benchmarks.remote`): Spark executors and
torchrun workers run its creators without ``benchmarks`` on their path.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Workload", "make_model", "make_big_model", "make_optimizer", "build"]


@dataclass(frozen=True)
class Workload:
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

    @classmethod
    def quick(cls) -> Workload:
        """A smoke-test size: 20k rows, 1 epoch."""
        return cls(rows=20_000, epochs=1)

    @property
    def config(self) -> dict:
        """The creators' ``config`` dict."""
        return {"features": self.features, "hidden": self.hidden, "lr": self.lr, "big_model_mb": self.big_model_mb}

    def to_json(self) -> str:
        """The workload as one JSON string (passed to contender subprocesses)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        """Reads what :meth:`to_json` wrote."""
        return cls(**json.loads(text))


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


def build(workload: Workload) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The seeded model and its optimizer, as every contender builds them."""
    torch.manual_seed(workload.seed)
    model = make_model(workload.config)
    return model, make_optimizer(model, workload.config)
