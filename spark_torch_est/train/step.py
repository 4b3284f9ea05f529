"""[executor] What the training loop is made of, below its order: where a rank is
(:class:`Stage`), the batch a step takes (:class:`Batch`), the way of a table's rows into the
model (:class:`Feed`, :func:`forward`, with errors told in the user's terms), the steps'
losses kept on the device until the loop reads them (:class:`PendingLosses`) and the report
of a non-finite loss (:func:`non_finite_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from spark_torch_est.core.progress import Progress
from spark_torch_est.core.schema import InputSchema, call_model
from spark_torch_est.errors import UserCodeError
from spark_torch_est.train.losses import NonFiniteLossError
from spark_torch_est.train.prefetch import Transfer, transfer_for

if TYPE_CHECKING:
    from spark_torch_est.core.schema import ModelInputs

__all__ = ["Stage", "Batch", "Feed", "forward", "checked_outputs", "READ_EVERY", "StepLoss", "PendingLosses",
           "non_finite_loss"]

#: Steps between two readings of the training losses on the host (and so between two
#: progress reports): a read waits for the device to finish the steps before it.
READ_EVERY = 10

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


class Feed:
    """A table's rows on their way into the model: on the rank's device, as the model takes
    them, through its forward pass.

    Args:
        schema: The fit's input columns.
        device: The rank's device.
        batch_size: The ``batchSize`` Param, and ...
        train_rows: ... the training rows of every rank, both named by errors that depend on them.

    Attributes:
        transfer: How batches are copied to the device ahead of their step (None on the CPU).
    """

    def __init__(self, schema: InputSchema, device: torch.device, batch_size: int, train_rows: list[int]) -> None:
        self.schema, self.device, self.batch_size, self.train_rows = schema, device, batch_size, train_rows
        self.transfer: Transfer | None = transfer_for(device)

    def model_inputs(self, inputs: Sequence[torch.Tensor]) -> ModelInputs:
        """A batch's column tensors on the device, as the model takes them."""
        return self.schema.model_inputs([x.to(self.device, non_blocking=True) for x in inputs])

    def batch(self, inputs: Sequence[torch.Tensor], labels: torch.Tensor, weights: torch.Tensor | None) -> Batch:
        """A batch of a table's rows on the device."""
        return Batch(self.model_inputs(inputs), labels.to(self.device, non_blocking=True),
                     weights.to(self.device, non_blocking=True) if weights is not None else None)

    def forward(self, model: nn.Module, inputs: ModelInputs) -> torch.Tensor:
        """``model`` on one batch (see :func:`forward`)."""
        return forward(model, inputs, self.schema, self.batch_size, self.train_rows)


def forward(model: nn.Module, inputs: ModelInputs, schema: InputSchema, batch_size: int,
            train_rows: list[int]) -> torch.Tensor:
    """The model on one batch (see :func:`schema.call_model`). An id past an embedding's
    table, or BatchNorm on a one-row batch, raises an error that says where it came from
    (the columns' ids; ``batchSize`` and the training rows per worker).

    Raises:
        UserCodeError: The model returned something other than a tensor.
    """
    try:
        return checked_outputs(call_model(model, inputs), model)
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


def checked_outputs(outputs: Any, model: nn.Module, method: str = "forward") -> torch.Tensor:
    """The outputs of ``model``'s forward (or the ``method`` scoring called, a
    LightningModule's ``predict_step``), if they are one tensor: the loss, the metrics, the
    labels' shape and ``transform`` take them as one.

    Raises:
        UserCodeError: They are not (a tuple, a dict, ...), naming the model and the method.
    """
    if isinstance(outputs, torch.Tensor):
        return outputs
    while True:  # the user's model inside DDP and a compiled module
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule":
            model = getattr(model, "_orig_mod")  # noqa: B009 - nn.Module types its attributes Tensor | Module
        else:
            break
    raise UserCodeError.returned(
        f"the model's {method} ({type(model).__qualname__})", outputs,
        "one torch.Tensor of outputs, a row per input row: the loss, the metrics and transform take it",
        "return that tensor alone (a model that returns more can be wrapped in a module whose forward returns "
        "the one tensor, e.g. model(x)[0] or model(x)['logits'])")


@dataclass(frozen=True)
class StepLoss:
    """One step's loss, read on the host.

    Attributes:
        value: The loss.
        rows: Its weight in the epoch's mean: the batch's rows, or the sum of their weights.
        progress: The run's progress after the step.
        batch_idx: The step's batch in its epoch.
        position: The step's place in the epoch's plan (:class:`~spark_torch_est.ingest.canonical.EpochPlan`).
    """

    value: float
    rows: float
    progress: Progress
    batch_idx: int
    position: int


class PendingLosses:
    """The steps' losses since the loop last read them, kept on the device: a step adds its
    loss without waiting for the device (a GPU runs ahead of the host), and :meth:`read`
    takes every kept loss to the host in one transfer.

    Args:
        device: Where the losses are gathered before they are read.
        every: Steps after which :meth:`add` says a reading is due.
    """

    def __init__(self, device: torch.device, every: int = READ_EVERY) -> None:
        self.device = device
        self.every = every
        self._tensors: list[torch.Tensor] = []  # each step's loss, then its weight when a tensor
        self._steps: list[tuple[float | None, Progress, int, int]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, loss: torch.Tensor, rows: torch.Tensor | float, progress: Progress, batch_idx: int,
            position: int) -> bool:
        """Keeps one step's ``loss`` and its weight ``rows`` (a number, or a tensor on the
        device); returns whether a reading is due."""
        self._tensors.append(loss.detach())
        if isinstance(rows, torch.Tensor):
            self._tensors.append(rows.detach())
            self._steps.append((None, progress, batch_idx, position))
        else:
            self._steps.append((float(rows), progress, batch_idx, position))
        return len(self._steps) >= self.every

    def read(self) -> list[StepLoss]:
        """Every kept step's loss, in step order, read on the host at once; forgets them."""
        if not self._steps:
            return []
        values = iter(torch.stack([t.to(self.device, torch.float64) for t in self._tensors]).tolist())
        read = []
        for rows, progress, batch_idx, position in self._steps:
            value = next(values)
            read.append(StepLoss(value, next(values) if rows is None else rows, progress, batch_idx, position))
        self._tensors, self._steps = [], []
        return read


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
