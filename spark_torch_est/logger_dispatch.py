"""[driver] Delivers one fit's events to the estimator's loggers.

Channel messages arrive on the channel's reader threads; they are queued here and handed
to the loggers by one delivery thread, so a slow tracking server never holds up the
channel (which also carries the checkpoint) and loggers are never called concurrently.
``on_fit_start``, ``on_fit_end`` and ``on_fit_failed`` run in the thread that called
``fit`` (where a tracking library's thread-local state, such as an active MLflow run,
is visible), before the delivery thread starts and after it has finished.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Iterable

from spark_torch_est.checkpoint import Checkpoint
from spark_torch_est.loggers import Logger, plan_events
from spark_torch_est.progress import Progress

__all__ = ["LoggerDispatch"]

logger = logging.getLogger(__name__)

_STOP = object()


class LoggerDispatch:
    """The loggers of one fit: throttled steps, each history entry once, and a logger that
    raises is logged and skipped, never failing the fit.

    Args:
        loggers: The estimator's loggers.
        run_id: The estimator run's id (offered to every event as ``run_id``).
        start: Where the run stands when the fit starts; the epochs it has completed were
            logged by earlier fits and are not logged again.
    """

    def __init__(self, loggers: Iterable[Logger], run_id: str, start: Progress) -> None:
        self._plans = [(item, plan_events(item)) for item in loggers]
        self._run_id = run_id
        self._logged_epochs = set(range(1, start.epoch + 1))
        self._last_step: dict[int, float] = {}
        self._benched: set[int] = set()  # loggers whose on_fit_start raised
        self._warned: set[tuple[int, str]] = set()
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    def start(self, params: dict[str, Any], config: dict[str, Any], progress: Progress,
              name: str | None = None) -> None:
        """Calls ``on_fit_start``, then starts delivering channel messages."""
        if not self._plans:
            return
        self._emit("on_fit_start", params=params, config=config, progress=progress, name=name)
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._deliver, name="spark_torch_est-loggers", daemon=True)
        self._thread.start()

    def handle(self, message: dict) -> None:
        """Queues one channel message for the loggers (called from channel threads)."""
        if self._queue is not None:
            self._queue.put(message)

    def finish(self, model: Any, checkpoint: Checkpoint) -> None:
        """After a successful fit: the history entries no message delivered, then ``on_fit_end``."""
        self._stop()
        for entry in checkpoint.history:
            self._epoch(entry)
        self._emit("on_fit_end", model=model, checkpoint=checkpoint)

    def fail(self, error: BaseException) -> None:
        """After a failed or interrupted fit: ``on_fit_failed``."""
        self._stop()
        self._emit("on_fit_failed", error=error)

    def _stop(self) -> None:
        """Delivers what is queued, then stops the delivery thread."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join()
        self._queue = self._thread = None

    def _deliver(self) -> None:
        while (message := self._queue.get()) is not _STOP:
            try:
                if message.get("type") == "progress":
                    self._step(message)
                elif message.get("type") == "epoch":
                    self._epoch(message["entry"])
            except (KeyError, TypeError, ValueError) as error:  # a message of another version
                logger.debug("loggers skipped a malformed %s message: %s", message.get("type"), error)

    def _step(self, message: dict) -> None:
        when = float(message["time"])
        due = {i for i, (item, _) in enumerate(self._plans)
               if when - self._last_step.get(i, float("-inf")) >= item.step_interval_s}
        for index in due:
            self._last_step[index] = when
        self._emit("on_step", due, progress=Progress.from_dict(message), loss=float(message["loss"]))

    def _epoch(self, entry: dict) -> None:
        epoch = int(entry["epoch"])
        if epoch not in self._logged_epochs:
            self._logged_epochs.add(epoch)
            self._emit("on_epoch_end", metrics=dict(entry))

    def _emit(self, event: str, only: set[int] | None = None, **arguments: Any) -> None:
        arguments["run_id"] = self._run_id
        for index, (item, plan) in enumerate(self._plans):
            invoke = plan.get(event)
            if invoke is None or index in self._benched or (only is not None and index not in only):
                continue
            try:
                invoke(arguments)
            except Exception as error:  # a logger never fails the fit
                self._failed(index, item, event, error)

    def _failed(self, index: int, item: Logger, event: str, error: Exception) -> None:
        if event == "on_fit_start":
            self._benched.add(index)
        first = (index, event) not in self._warned
        self._warned.add((index, event))
        logger.log(logging.WARNING if first else logging.DEBUG,
                   "logger %s failed in %s (the fit goes on%s): %s: %s", type(item).__name__, event,
                   "; it sits out the rest of this fit" if event == "on_fit_start" else "",
                   type(error).__name__, error, exc_info=first)
