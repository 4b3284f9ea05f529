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
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from spark_torch_est.train.devices import to_cpu

__all__ = ["is_stateful", "MetricAccumulator", "format_entry"]


def is_stateful(metric: Any) -> bool:
    """Whether ``metric`` keeps state (``update`` / ``compute``) instead of being a function."""
    return hasattr(metric, "update") and hasattr(metric, "compute")


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
        """Adds one batch (with its rows' weights, if any); returns its loss."""
        rows: float
        if weights is None:
            loss, rows = self.loss_fn(outputs, labels), len(outputs)
        else:
            loss, rows = self.loss_fn(outputs, labels, weights), float(weights.sum())
        self._sums[0] += rows
        self._sums[1] += float(loss) * rows
        for i, name in enumerate(self.names, start=2):
            metric = self.metrics[name]
            if is_stateful(metric):
                metric.update(outputs, labels)
            else:
                self._sums[i] += float(metric(outputs, labels)) * rows
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
                values[name] = float(metric.compute())
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
