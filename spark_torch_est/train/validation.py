"""[executor] The validation at the end of an epoch: every rank's validation rows through
the model, with the hooks around each batch, and the loss and metrics over all ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spark_torch_est.ingest.agreement import AgreedRows
from spark_torch_est.train.metrics import MetricAccumulator
from spark_torch_est.train.precision import Precision
from spark_torch_est.train.prefetch import prefetch
from spark_torch_est.train.step import Feed, Stage
from spark_torch_est.train.strategies.base import Strategy

__all__ = ["Validation"]


class Validation:
    """Validates the model on one rank, in step with the other ranks.

    Args:
        rows: The fit's rows: the validation table (a training row makes the extra forward
            passes a strategy may ask for).
        feed: Puts rows on the device and runs the model.
        metrics: The validation's loss and metrics.
        precision: The fit's autocast.
        strategy: How many forward passes each rank makes, and the ranks to sum over.
        stage: Where the rank is, named if something raises.
        call: Calls a stage's hooks: ``call(stage, batch=None, **extra)``.
    """

    def __init__(self, rows: AgreedRows, feed: Feed, metrics: MetricAccumulator, precision: Precision,
                 strategy: Strategy, stage: Stage, call: Callable[..., Any]) -> None:
        self.rows, self.feed, self.metrics, self.precision = rows, feed, metrics, precision
        self.strategy, self.stage, self.call = strategy, stage, call

    def run(self, model: nn.Module) -> dict[str, float]:
        """``{"val_loss": ..., "val_<metric>": ...}`` over every rank's validation rows,
        weighted by rows (or by their weights), with ``before_val_epoch`` and
        ``after_val_epoch`` around it (the latter may add values). Collective."""
        self.call("before_val_epoch")
        with self.stage.at("validation"):
            totals = self._totals(model)
        with self.stage.at("collective"):
            results = self.metrics.results(self.strategy.ranks.all_reduce(totals))
        values = {f"val_{name}": value for name, value in results.items()}
        self.call("after_val_epoch", metrics=values)  # hooks may add to the entry
        return values

    def _totals(self, model: nn.Module) -> torch.Tensor:
        """This rank's sums of the validation loss and metrics, with the hooks around each
        batch, the model in eval mode and without gradients."""
        table, size, metrics, feed = self.rows.validation, self.feed.batch_size, self.metrics, self.feed
        metrics.reset()
        model.eval()
        starts = range(0, len(table), size)
        with self.stage.at("collective"):
            passes = self.strategy.forward_passes(len(starts))
        with torch.no_grad():
            for start, rows in zip(starts, prefetch((table.slice(s, s + size) for s in starts), feed.transfer)):
                batch = feed.batch(*rows)
                self.call("before_val_iter", batch, batch_idx=start // size)
                with self.precision.autocast():
                    outputs = feed.forward(model, batch.inputs)
                    loss = metrics.update(outputs, batch.labels, batch.weights)
                self.call("after_val_iter", batch, batch_idx=start // size, outputs=outputs, loss=loss)
            if passes > len(starts):  # forward passes the other ranks make together with this one
                inputs = feed.model_inputs(self.rows.train.slice(0, 1)[0])
                for _ in range(passes - len(starts)):
                    with self.precision.autocast():
                        feed.forward(model, inputs)
        model.train()
        return metrics.totals()
