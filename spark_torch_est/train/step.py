"""[executor] What the training loop is made of, below its order: where a rank is
(:class:`Stage`), the batch a step takes (:class:`Batch`), the model's forward pass with its
errors told in the user's terms (:func:`forward`) and the report of a non-finite loss
(:func:`non_finite_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from spark_torch_est.core.schema import InputSchema, call_model
from spark_torch_est.train.losses import NonFiniteLossError

if TYPE_CHECKING:
    from spark_torch_est.core.schema import ModelInputs

__all__ = ["Stage", "Batch", "forward", "non_finite_loss"]

_ONE_ROW_BATCH_NORM = "Expected more than 1 value per channel when training"


class Stage:
    """What a rank is doing, named when something raises: a hook stage or a loop step
    (``"setup"``, ``"train"``, ``"forward"``, ``"collective"``, ...).

    Args:
        name: The stage to begin with.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._before: list[str] = []

    def at(self, name: str) -> Stage:
        """``with stage.at(name):`` marks the code inside as ``name``. The stage before comes
        back when it ends, not when it raises: a failure keeps the stage it happened at."""
        self._before.append(self.name)
        self.name = name
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, *_: Any) -> None:
        before = self._before.pop()
        if kind is None:
            self.name = before


@dataclass(frozen=True)
class Batch:
    """One batch on the rank's device, as the model and the hooks take it.

    Attributes:
        inputs: The model's inputs (see :meth:`InputSchema.model_inputs`).
        labels: The labels, shaped as the loss expects them.
        weights: The rows' sample weights, or None without ``weightCol``.
    """

    inputs: ModelInputs
    labels: torch.Tensor
    weights: torch.Tensor | None = None

    def replaced(self, batch: Sequence[Any]) -> Batch:
        """This batch with the ``(inputs, labels)`` a ``before_train_iter`` hook returned."""
        return Batch(batch[0], batch[1], self.weights)

    def arguments(self) -> dict[str, Any]:
        """Its hook arguments: ``batch`` (``(inputs, labels)``), ``inputs``, ``labels``, ``weights``."""
        return {"batch": (self.inputs, self.labels), "inputs": self.inputs, "labels": self.labels,
                "weights": self.weights}


def forward(model: nn.Module, inputs: ModelInputs, schema: InputSchema, batch_size: int,
            train_rows: list[int]) -> torch.Tensor:
    """The model on one batch (see :func:`schema.call_model`). An id past an embedding's
    table, or BatchNorm on a one-row batch, raises an error that says where it came from
    (the columns' ids; ``batchSize`` and the training rows per worker)."""
    try:
        return call_model(model, inputs)
    except IndexError as error:
        if "index out of range" not in str(error):
            raise
        tensors = inputs if isinstance(inputs, tuple) else (inputs,)
        ids = [(c.name, x) for c, x in zip(schema.columns, tensors) if x.dtype == torch.int64 and x.numel()]
        if not ids:
            raise
        ranges = ", ".join(f"{name!r} holds {int(x.min())}..{int(x.max())}" for name, x in ids)
        raise IndexError(f"{error}: an id is out of an embedding's range; in this batch {ranges} (an nn.Embedding "
                         "of n rows takes ids 0..n-1)") from None
    except ValueError as error:
        rows = len(inputs[0] if isinstance(inputs, tuple) else inputs)
        if _ONE_ROW_BATCH_NORM not in str(error) or rows != 1:
            raise
        raise ValueError(
            f"{error}: a batch of this epoch has a single row (batchSize={batch_size}, training rows "
            f"per worker {train_rows}), and BatchNorm cannot train on one row. Choose a batchSize that "
            "leaves more than one row in the last batch of each worker"
        ) from None


def non_finite_loss(value: float, batch: Batch, schema: InputSchema, label_col: str, where: str) -> NonFiniteLossError:
    """The error of a loss ``value`` that is NaN or infinite at ``where`` (epoch, batch, rank),
    naming the batch's columns that hold NaN or infinite values."""
    inputs = batch.inputs if isinstance(batch.inputs, tuple) else (batch.inputs,)
    named = [(f"column {c.name!r}", x) for c, x in zip(schema.columns, inputs)]
    named.append((f"labelCol {label_col!r}", batch.labels))
    bad = [name for name, tensor in named if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
           and not bool(torch.isfinite(tensor).all())]
    return NonFiniteLossError(
        f"non-finite loss ({value}) at {where}: "
        + (f"the batch's {' and '.join(bad)} hold NaN or infinite values" if bad else
           "the model diverged (lower the learning rate, clip gradients)")
        + "; set allowNonFinite=True to train on regardless"
    )
