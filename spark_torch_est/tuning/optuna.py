"""[driver] OptunaPruning: reports each epoch's metric to an Optuna trial and stops a fit
the trial's pruner prunes (public as :class:`spark_torch_est.tuning.halving.OptunaPruning`).

Needs ``optuna`` (``pip install 'spark-torch-est[optuna]'``), imported when the logger is made.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from spark_torch_est.errors import InvalidInputError
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

    A copy of the logger (``est.copy()``) reports to the same trial. It is not saved: an
    estimator holding it refuses ``save`` (a trial cannot outlive its objective: a loaded
    copy would report to a copy of the study that no one reads); save the estimator without
    it and add a new one for the trial after loading. Rank 0 waits at each epoch end for the
    answer, at most twice ``event_timeout_s``; past that the fit goes on and stops at the
    next epoch end.

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
        duplicate = object.__new__(type(self))
        duplicate.__dict__.update(self.__dict__)
        memo[id(self)] = duplicate
        return duplicate

    def __copy__(self) -> OptunaPruning:
        return self.__deepcopy__({})

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        """Refuses to be pickled (``est.save``): the pickle would hold a copy of the study, so a
        loaded estimator would prune nothing and report where no one reads.

        Raises:
            InvalidInputError: Always, saying what to do instead.
        """
        raise InvalidInputError(
            f"OptunaPruning (trial {getattr(self.trial, 'number', '?')}) cannot be saved with the estimator: it "
            "reports to the live optuna trial its objective received, and a loaded copy would report to a copy of "
            "the study that no one reads. Save the estimator without it (est.setLoggers([l for l in est.loggers if "
            "not isinstance(l, OptunaPruning)])) and, after loading, add one for the trial that fits it: "
            "loaded.setLoggers([*loaded.loggers, OptunaPruning(trial)])")

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
