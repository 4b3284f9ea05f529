"""[driver] The :class:`Logger` base class: the events a logger receives and their arguments.

Hooks run on the ranks; loggers run on the driver only. They are never pickled to the
executors, so no executor needs tracking credentials, and they add no work on the ranks:
they receive rank 0's throttled progress and per-epoch metrics from the fit's
authenticated channel, and the checkpoint when ``fit`` returns. The events of one fit::

    on_fit_start(params, config, progress, name)   once, before the barrier job starts
    on_step(progress, loss)                  rank 0's progress, at most every step_interval_s
    on_epoch_end(metrics)                    once per new history entry, live or when fit returns
    on_fit_end(model, checkpoint)            the fit succeeded
    on_fit_failed(error)                     the fit failed or was interrupted

A logger may also ask the fit to stop: ``should_stop(metrics)``, asked after each epoch's
``on_epoch_end``, returns True (or an exception for ``fit`` to raise) to stop every rank at
the end of that epoch, keeping its checkpoint. That is how a tuner prunes a trial.

Every event also offers ``run_id``, the estimator run's id: kept across the run's fits,
new after ``reset()``, ``copy()`` and for each ``CrossValidator`` fit. A logger keeps one
tracking run per estimator run by keying on it (:func:`run_folder` names its folder). Like
hook methods, a logger method names only the arguments it wants.

A logger's module imports, of this package, this base and nothing else but ``core`` and
``errors``: what a logger needs of the rest (the binding of an event's arguments, the run's
folder named as its checkpoints are) this module gives it. tests/unit/test_package.py checks
it for every :class:`Logger` subclass in the package.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from spark_torch_est.checkpoints.storage import short_run_id
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.train.hooks import bind_keywords

__all__ = ["Logger", "EVENT_ARGUMENTS", "normalize_loggers", "plan_events", "scalars", "tracked_params", "run_folder"]

#: The keyword arguments on offer at each event.
EVENT_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "on_fit_start": ("params", "config", "progress", "name", "run_id"),
    "on_step": ("progress", "loss", "run_id"),
    "on_epoch_end": ("metrics", "run_id"),
    "on_fit_end": ("model", "checkpoint", "run_id"),
    "on_fit_failed": ("error", "run_id"),
    "should_stop": ("metrics", "run_id"),
}


class Logger:
    """Base class for loggers. Override the events you need; each method declares only the
    keyword arguments it uses (see :data:`EVENT_ARGUMENTS`), or ``**kwargs`` for all. (The
    events here take ``*args, **kwargs`` so that a type checker accepts any such override;
    the arguments always come by keyword.)

    A logger that raises never fails the fit: the error is logged as a warning and the
    fit goes on; after a failed ``on_fit_start`` the logger sits out the fit until it ends,
    when ``on_fit_start`` is tried once more (then the epochs it missed and ``on_fit_end``).
    Events run in a thread of the logger's own, one at a time, never concurrently; one
    that has not returned after ``event_timeout_s`` is abandoned (a warning; the logger
    gets no more events in that fit) and the fit goes on.

    Attributes:
        step_interval_s: Least seconds between two ``on_step`` calls (default 1.0; set it
            on a class or an instance).
        event_timeout_s: Most seconds the fit waits for one event (default 60.0).
    """

    step_interval_s: float = 1.0
    event_timeout_s: float = 60.0

    def on_fit_start(self, *args: Any, **kwargs: Any) -> None:
        """Before the fit's barrier job starts. ``params``: the estimator's Param values by
        name; ``config``: its config dict; ``progress``: where the run stands; ``name``: for
        a fit with a param map, the map and, in a ``CrossValidator`` or
        ``TrainValidationSplit``, its fold or ``refit`` (``"batchSize=32 (fold 2)"``), else None."""

    def on_step(self, *args: Any, **kwargs: Any) -> None:
        """Rank 0's position after a step (``progress``) and that step's ``loss``; throttled."""

    def on_epoch_end(self, *args: Any, **kwargs: Any) -> None:
        """A completed epoch's history entry (``metrics``, with its 1-based ``"epoch"``)."""

    def on_fit_end(self, *args: Any, **kwargs: Any) -> None:
        """The fit succeeded: ``model`` is the TorchModel it returns, ``checkpoint`` its state."""

    def on_fit_failed(self, *args: Any, **kwargs: Any) -> None:
        """The fit raised ``error`` (a SparkTorchError, or KeyboardInterrupt on Ctrl-C); the
        estimator keeps its run as it was before the fit."""

    def should_stop(self, *args: Any, **kwargs: Any) -> bool | BaseException:
        """Whether the fit should stop at the end of the epoch whose ``metrics`` this logger
        has just taken in ``on_epoch_end``.

        Override it only in a logger that may stop fits: while such a logger is among the
        estimator's, rank 0 waits at each epoch end (at most twice this logger's
        ``event_timeout_s``) for its ``on_epoch_end`` and its answer. Return True to stop
        every rank at the end of that epoch (the estimator keeps its checkpoint, ``fit``
        returns as usual), or an exception to stop there and have ``fit`` raise it after
        ``on_fit_end``; False or None goes on (anything else is warned about and goes on).
        An answer that comes too late stops the fit at the next epoch end the ranks reach;
        without the driver's channel (Spark Connect) the answers come when ``fit`` returns,
        and only an exception still counts.
        """
        return False


def plan_events(logger: Logger) -> dict[str, Callable[[Mapping[str, Any]], Any]]:
    """``{event: invoker}`` for the events ``logger`` overrides; an invoker takes a mapping
    of the event's arguments and passes the ones the method names.

    Raises:
        InvalidInputError: A method asks for an argument its event does not offer.
    """
    owner = f"logger {type(logger).__name__}"
    return {
        event: bind_keywords(getattr(logger, event), event, allowed, owner)[0]
        for event, allowed in EVENT_ARGUMENTS.items()
        if getattr(type(logger), event, None) is not getattr(Logger, event)
    }


def normalize_loggers(loggers: Logger | Iterable[Logger] | None) -> list[Logger]:
    """Returns loggers as a list, checked.

    Raises:
        InvalidInputError: An entry is not a :class:`Logger`, or a method asks for an
            argument its event does not offer.
    """
    if loggers is None:
        return []
    if isinstance(loggers, Logger):
        loggers = [loggers]
    if not isinstance(loggers, (list, tuple)):
        raise InvalidInputError(f"loggers must be a list of Logger, got {type(loggers).__name__}")
    for index, logger in enumerate(loggers):
        if not isinstance(logger, Logger):
            raise InvalidInputError(
                f"loggers[{index}] must be a spark_torch_est.loggers.Logger instance, got {type(logger).__name__}"
            )
        plan_events(logger)
        for name in ("step_interval_s", "event_timeout_s"):
            value = getattr(logger, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise InvalidInputError(f"loggers[{index}].{name} must be a number of seconds >= 0, got {value!r}")
    return list(loggers)


def tracked_params(params: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The Params and the config (as ``config.<key>``) in one flat dict, as trackers log them."""
    return {**params, **{f"config.{key}": value for key, value in config.items()}}


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a history entry, without its ``"epoch"``."""
    return {key: float(value) for key, value in metrics.items()
            if key != "epoch" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def run_folder(log_dir: str, run_id: str) -> str:
    """The folder of the estimator run ``run_id`` under ``log_dir``, named by the run's short
    id as its checkpoints are."""
    return os.path.join(log_dir, short_run_id(run_id))
