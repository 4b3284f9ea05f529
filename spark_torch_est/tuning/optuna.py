"""[driver] OptunaPruning: reports each epoch's metric to an Optuna trial and stops a fit
the trial's pruner prunes (public as :class:`spark_torch_est.tuning.halving.OptunaPruning`).

Needs ``optuna`` (``pip install 'spark-torch-est[optuna]'``), imported when the logger is made.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from spark_torch_est.loggers.base import Logger

if TYPE_CHECKING:
    import optuna

__all__ = ["OptunaPruning"]


class OptunaPruning(Logger):
    """Prunes an Optuna trial from the driver: put it in the estimator's ``loggers``.

    After each epoch it reports the epoch's ``monitor`` value to the trial
    (``trial.report(value, epoch)``, epochs counted from 1 across the run's fits); when
    ``trial.should_prune()`` then says so, every rank stops at the end of that epoch, the
    estimator keeps that epoch's checkpoint (``est.progress``, ``est.checkpoint``), the other
    loggers get ``on_fit_end``, and ``fit`` raises ``optuna.TrialPruned``, which
    ``study.optimize`` records as a pruned trial.

    A copy of the logger (``est.copy()``) reports to the same trial. Rank 0 waits at each
    epoch end for the answer, at most twice ``event_timeout_s``; past that the fit goes on
    and stops at the next epoch end.

    Args:
        trial: The ``optuna.Trial`` the objective received.
        monitor: The history entry to report (default ``"val_loss"``: set
            ``validationIndicatorCol``); e.g. ``"train_loss"`` or ``"val_<metric>"``.
    """

    def __init__(self, trial: optuna.Trial, monitor: str = "val_loss") -> None:
        import optuna  # noqa: F401 - fails here, naming the missing package, not in an epoch's end

        self.trial = trial
        self.monitor = monitor

    def __deepcopy__(self, memo: dict[int, Any]) -> OptunaPruning:
        """A copy reporting to the same trial (the trial stands for the study's storage)."""
        duplicate = copy.copy(self)
        memo[id(self)] = duplicate
        return duplicate

    def on_epoch_end(self, metrics: Mapping[str, Any]) -> None:
        """Reports the epoch's ``monitor`` value to the trial.

        Raises:
            KeyError: The entry has no ``monitor`` (the fit goes on; the dispatch warns).
        """
        if self.monitor not in metrics:
            names = ", ".join(sorted(k for k in metrics if k != "epoch"))
            raise KeyError(f"OptunaPruning: monitor {self.monitor!r} is not in the epoch's metrics ({names}); "
                           "set validationIndicatorCol for val_loss, or monitor= one of them")
        self.trial.report(float(metrics[self.monitor]), step=int(metrics["epoch"]))

    def should_stop(self, metrics: Mapping[str, Any]) -> bool | BaseException:
        """``optuna.TrialPruned`` when the trial's pruner prunes it now, else False."""
        import optuna

        if not self.trial.should_prune():
            return False
        value = float(metrics[self.monitor])
        shown = f"{value:.6g}" if math.isfinite(value) else str(value)
        return optuna.TrialPruned(f"trial {self.trial.number} pruned after epoch {int(metrics['epoch'])} "
                                  f"({self.monitor}={shown})")
