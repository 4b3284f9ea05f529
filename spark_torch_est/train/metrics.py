"""[both] The loss and metrics over many batches, weighted by rows: one definition for the
validation of every epoch and for ``TorchModel.evaluate``.

A metric is either a callable ``(outputs, labels) -> number``, averaged over rows, or a
stateful metric (``update`` and ``compute``, e.g. torchmetrics). Partial results of
ranks or partitions combine exactly: sums are added (an all-reduce, or on the driver),
stateful metrics merge their states, which travel as tensors (``torch.save``, read back
weights-only), never as pickles.
"""

from __future__ import annotations

import io
import numbers
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from spark_torch_est.errors import InvalidInputError, UserCodeError
from spark_torch_est.train.devices import to_cpu
from spark_torch_est.train.losses import scalar_loss

__all__ = ["is_stateful", "check_metrics", "MetricAccumulator", "format_entry"]

_ONE_VALUE = "a number or a tensor holding one value"


def is_stateful(metric: Any) -> bool:
    """Whether ``metric`` keeps state (``update`` / ``compute``) instead of being a function."""
    return hasattr(metric, "update") and hasattr(metric, "compute")


def check_metrics(metrics: Any) -> dict[str, Any]:
    """``metrics`` as a ``{name: metric}`` dict, each a callable or a stateful metric.

    Raises:
        InvalidInputError: It is not a dict with string keys, or a metric is neither, naming it.
    """
    if metrics is None or (not isinstance(metrics, Mapping) and not metrics):  # None, [] or (): no metrics
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidInputError(f"metrics must be a {{name: metric}} dict, got {type(metrics).__name__}")
    for name, metric in metrics.items():
        if not isinstance(name, str):
            raise InvalidInputError(f"metrics: the name {name!r} is not a string; name each metric (its history "
                                    "entry is val_<name>)")
        if not (callable(metric) or is_stateful(metric)):
            raise InvalidInputError(f"metrics[{name!r}] must be a callable(outputs, labels) -> number or a "
                                    f"stateful metric with update() and compute() (e.g. torchmetrics), got "
                                    f"{type(metric).__name__}")
    return dict(metrics)


def _one_value(value: Any, owner: str) -> float:
    """``value`` (what ``owner`` returned) as a float, if it is one number.

    Raises:
        UserCodeError: It is not a number or a one-value tensor, naming ``owner``.
    """
    if (isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, numbers.Real)
            or isinstance(value, np.ndarray) and value.size == 1):
        return float(value)
    raise UserCodeError.returned(
        owner, value, _ONE_VALUE + " (the batch's mean)",
        "a metric that gives several values goes in as one metric per value (a dict of values, e.g. a "
        "MetricCollection, as several entries of metrics=)" if isinstance(value, Mapping) else
        "reduce it to one value (e.g. .mean())")


class MetricAccumulator:
    """Sums of the loss and of function metrics, and updates of stateful metrics.

    With sample weights, the loss and function metrics are weighted means (each batch
    counts with its total weight; the loss is exact, function metrics exact when they are
    per-row means); stateful metrics see the rows unweighted.

    Args:
        loss_fn: The loss, called on each batch (a :class:`spark_torch_est.train.losses.Loss`
            when weights are given).
        metrics: ``{name: metric}``; names come out sorted.
        device: Where stateful metrics keep their state.
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor], metrics: Mapping[str, Any],
                 device: torch.device) -> None:
        self.loss_fn = loss_fn
        self.names = sorted(metrics)
        self.metrics = {name: metrics[name].to(device) if hasattr(metrics[name], "to") else metrics[name]
                        for name in self.names}
        self.reset()

    def reset(self) -> None:
        """Forgets every batch seen so far."""
        self._sums = torch.zeros(2 + len(self.names), dtype=torch.float64)
        for metric in self.metrics.values():
            if hasattr(metric, "reset"):
                metric.reset()

    def update(self, outputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Adds one batch (with its rows' weights, if any); returns its loss.

        Raises:
            UserCodeError: The loss or a function metric returned something other than one value.
        """
        rows: float
        if weights is None:
            loss, rows = self.loss_fn(outputs, labels), len(outputs)
        else:
            loss, rows = self.loss_fn(outputs, labels, weights), float(weights.sum())
        self._sums[0] += rows
        self._sums[1] += float(scalar_loss(loss, self.loss_fn)) * rows
        for i, name in enumerate(self.names, start=2):
            metric = self.metrics[name]
            if is_stateful(metric):
                metric.update(outputs, labels)
            else:
                self._sums[i] += _one_value(metric(outputs, labels), f"metric {name!r}") * rows
        return loss

    def totals(self) -> torch.Tensor:
        """``[rows (or weight), loss sum, metric sums...]`` in float64, to add up across ranks
        or partitions."""
        return self._sums.clone()

    def results(self, totals: torch.Tensor) -> dict[str, float]:
        """``{"loss": ..., name: ...}`` from totals added up over every part; stateful
        metrics report their own ``compute()`` (merged or synchronized beforehand)."""
        rows = float(totals[0])
        values = {"loss": _mean(float(totals[1]), rows)}
        for i, name in enumerate(self.names, start=2):
            metric = self.metrics[name]
            if not is_stateful(metric):
                values[name] = _mean(float(totals[i]), rows)
                continue
            with warnings.catch_warnings():  # merged states count no update() of their own
                warnings.filterwarnings("ignore", message=".*was called before the ``update`` method")
                values[name] = _one_value(metric.compute(), f"metric {name!r} ({type(metric).__name__}).compute()")
        return values

    def states(self) -> list[bytes]:
        """Each stateful metric's state as ``torch.save`` bytes (b"" for function metrics)."""
        blobs = []
        for name in self.names:
            metric = self.metrics[name]
            if not is_stateful(metric):
                blobs.append(b"")
                continue
            buffer = io.BytesIO()
            torch.save(to_cpu(dict(metric.metric_state)), buffer)
            blobs.append(buffer.getvalue())
        return blobs

    def merge(self, name: str, blob: bytes) -> None:
        """Merges a state from :meth:`states` into the stateful metric ``name``.

        Raises:
            TypeError: The metric cannot merge states (it has no ``merge_state``).
        """
        metric = self.metrics[name]
        if not hasattr(metric, "merge_state"):
            raise TypeError(f"metric {name!r} has no merge_state(), so partitions cannot be combined")
        metric.merge_state(torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True))


def _mean(total: float, weight: float) -> float:
    """``total / weight``; NaN when nothing counted (no rows, or weights that are all 0)."""
    return total / weight if weight else float("nan")


def format_entry(entry: Mapping[str, Any]) -> str:
    """A history entry without its epoch, for a log line: ``"train_loss=0.5, world_size=2"``
    (floats to 6 significant digits, anything else, e.g. a branch's ``branch_of``, as it is)."""
    return ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items() if k != "epoch")
