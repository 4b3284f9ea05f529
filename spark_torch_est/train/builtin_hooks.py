"""[both] Hooks most training runs want: early stopping, gradient clipping, per-step LR
scheduling, throughput, and changing optimizer settings between fits."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from spark_torch_est.train.hooks import Control, Hook

__all__ = ["EarlyStopping", "GradientClipping", "SchedulerPerIteration", "Throughput", "SetHyperparameters"]


class EarlyStopping(Hook):
    """Stops the run when a metric of the history stops improving.

    The state (best value, epochs without improvement, whether it stopped) survives fits:
    once it has stopped, later fits end at once until ``est.reset()``.

    Args:
        monitor: A key of the per-epoch history, e.g. ``"val_loss"`` (default) or ``"train_loss"``.
        patience: Epochs without improvement before stopping (default 3).
        mode: ``"min"`` (default) or ``"max"``.
        min_delta: The smallest change that counts as an improvement (default 0).
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 3, mode: str = "min", min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.bad_epochs = 0
        self.stopped_epoch: int | None = None

    def before_run(self, control: Control) -> None:
        if self.stopped_epoch is not None:
            control.stop_training = True

    def after_train_epoch(self, metrics: dict, control: Control) -> None:
        if self.monitor not in metrics:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}, but the epoch has only {sorted(metrics)}")
        value = float(metrics[self.monitor])
        improved = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if improved:
            self.best, self.bad_epochs = value, 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            self.stopped_epoch = int(metrics["epoch"])
            control.stop_training = True

    def state_dict(self) -> dict:
        return {"best": self.best, "bad_epochs": self.bad_epochs, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad_epochs, self.stopped_epoch = state["best"], state["bad_epochs"], state["stopped_epoch"]


class GradientClipping(Hook):
    """Clips the gradient norm before every optimizer step (gradients are already
    averaged across ranks, so every rank clips the same way).

    Args:
        max_norm: The largest allowed total norm.
        norm_type: The p of the p-norm (default 2).
    """

    def __init__(self, max_norm: float, norm_type: float = 2.0) -> None:
        self.max_norm, self.norm_type = max_norm, norm_type

    def before_optimizer_step(self, model: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm, norm_type=self.norm_type)


class SchedulerPerIteration(Hook):
    """Steps the LR scheduler after every training step instead of every epoch (also
    with a ``train_step`` override)."""

    def before_run(self, control: Control) -> None:
        control.step_scheduler_per_epoch = False

    def after_train_iter(self, scheduler: Any) -> None:
        if scheduler is not None:
            scheduler.step()


class Throughput(Hook):
    """Adds ``samples_per_s`` (all ranks together) and ``epoch_time_s`` to each history entry."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._samples_at_start = 0

    def before_train_epoch(self, state: Any) -> None:
        self._started, self._samples_at_start = time.perf_counter(), state.samples

    def after_train_epoch(self, metrics: dict, state: Any) -> None:
        if self._started is None:  # the epoch began in an earlier fit
            return
        elapsed = time.perf_counter() - self._started
        metrics["epoch_time_s"] = elapsed
        metrics["samples_per_s"] = (state.samples - self._samples_at_start) / elapsed if elapsed > 0 else 0.0
        self._started = None


class SetHyperparameters(Hook):
    """Sets optimizer hyper-parameters (``lr``, ``weight_decay``, ...) at the start of
    each fit, after the optimizer state was restored: the way to fine-tune with a new
    learning rate on top of the run's optimizer state.

    Args:
        **values: Param-group entries to set; change ``hook.values`` between fits.

    Example:
        >>> tune = SetHyperparameters()
        >>> # est = TorchEstimator(..., hooks=[tune]); est.fit(df)
        >>> tune.values = {"lr": 1e-4}  # the next fit continues with lr 1e-4
    """

    def __init__(self, **values: float) -> None:
        self.values = dict(values)

    def before_run(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group.update(self.values)
