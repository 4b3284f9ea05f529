"""[driver] Delivers one fit's events to the estimator's loggers, each within a deadline.

The ranks' messages arrive, decoded, on the channel's reader threads; they are queued
here and handed to the loggers by one delivery thread, so a slow tracking server never
holds up the channel (which also carries the checkpoint). Every event, ``on_fit_start``,
``on_fit_end`` and ``on_fit_failed`` included, runs in the logger's own thread while the
caller waits at most the logger's ``event_timeout_s``: a logger that does not return by
then is abandoned for the rest of the fit with a warning (its thread is left to finish
on its own), so no logger can keep ``fit`` from starting the job or from returning. A
logger's events run one at a time, in order.

A logger that overrides ``should_stop`` may stop the fit: it takes each epoch's entry
before the other loggers, is asked right after, and :meth:`LoggerDispatch.stop_asked`
(which the channel calls when rank 0 asks at an epoch end) waits, within the deadlines, for
that epoch's answer.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.cluster.messages import Kind, RankMessage
from spark_torch_est.core.progress import Progress
from spark_torch_est.loggers.base import Logger, plan_events

__all__ = ["LoggerDispatch"]

logger = logging.getLogger(__name__)

_STOP = object()
_TIMED_OUT = object()


class _Runner:
    """One logger's thread: runs its events one at a time; the caller waits with a deadline."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"spark_torch_est-logger-{name}", daemon=True)
        self._thread.start()

    def call(self, invoke: Callable[[Mapping[str, Any]], Any], arguments: Mapping[str, Any],
             timeout: float) -> tuple[Any, Exception | object | None]:
        """Runs ``invoke(arguments)``: ``(its value, None)`` when it returned, ``(None, its
        exception)`` when it raised, ``(None, _TIMED_OUT)`` when it was still running after
        ``timeout`` seconds."""
        done = threading.Event()
        outcome: list[Any] = [None, None]

        def job() -> None:
            try:
                outcome[0] = invoke(arguments)
            except Exception as error:  # handed to the caller, which logs it
                outcome[1] = error
            finally:
                done.set()

        self._jobs.put(job)
        if not done.wait(timeout):
            return None, _TIMED_OUT
        return outcome[0], outcome[1]

    def close(self) -> None:
        """Ends the thread once its current event (if any) returns."""
        self._jobs.put(_STOP)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            job()


class LoggerDispatch:
    """The loggers of one fit: throttled steps, each history entry once per logger (marked
    logged only when the logger's call returned), a logger that raises is logged and
    skipped, and one that does not return within its deadline is abandoned; none ever
    fails or holds up the fit. A logger that overrides ``should_stop`` may ask the fit to
    stop (see :meth:`stop_asked`).

    Args:
        loggers: The estimator's loggers.
        run_id: The estimator run's id (offered to every event as ``run_id``).
        start: Where the run stands when the fit starts; the epochs it has completed were
            logged by earlier fits and are not logged again.
    """

    def __init__(self, loggers: Iterable[Logger], run_id: str, start: Progress) -> None:
        self._plans = [(item, plan_events(item)) for item in loggers]
        self._run_id = run_id
        self._logged = [set(range(1, start.epoch + 1)) for _ in self._plans]  # per logger: epochs it took
        self._last_step: dict[int, float] = {}
        self._benched: set[int] = set()  # loggers whose on_fit_start raised: tried again when the fit ends
        self._abandoned: set[int] = set()  # loggers past their deadline: never called again in this fit
        self._warned: set[tuple[int, str]] = set()
        self._runners: dict[int, _Runner] = {}
        self._start_arguments: dict[str, Any] = {}
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._stoppers = {i for i, (_, plan) in enumerate(self._plans) if "should_stop" in plan}
        self._decision = threading.Condition()
        self._decided = start.epoch  # the last epoch whose stop question was answered (or timed out)
        self._stop_requested = False
        #: The exception a logger asked ``fit`` to raise (with the stop it asked for), or None.
        self.stop_error: BaseException | None = None

    @property
    def stop_wait_s(self) -> float | None:
        """Most seconds an epoch's stop question can take: ``on_epoch_end`` and ``should_stop``
        of every logger that may stop the fit, each within its deadline; None when none may."""
        if not self._stoppers:
            return None
        return sum(2 * self._timeout(i) for i in self._stoppers)

    def stop_asked(self, epoch: int, timeout: float) -> bool:
        """Whether a logger has asked the fit to stop, once the loggers that may ask have
        answered for ``epoch`` (waiting at most ``timeout`` seconds for them): rank 0's
        question at that epoch's end. A request that came after an earlier answer counts too."""
        with self._decision:
            self._decision.wait_for(lambda: self._decided >= epoch, timeout)
            return self._stop_requested

    def start(self, params: dict[str, Any], config: dict[str, Any], progress: Progress,
              name: str | None = None) -> None:
        """Calls ``on_fit_start``, then starts delivering channel messages."""
        if not self._plans:
            return
        self._start_arguments = {"params": params, "config": config, "progress": progress, "name": name}
        self._emit("on_fit_start", **self._start_arguments)
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._deliver, name="spark_torch_est-loggers", daemon=True)
        self._thread.start()

    def handle(self, message: RankMessage) -> None:
        """Queues one of the ranks' messages for the loggers (called from channel threads)."""
        if self._queue is not None:
            self._queue.put(message)

    def finish(self, model: Any, checkpoint: Checkpoint) -> None:
        """After a successful fit: ``on_fit_start`` again for a logger whose first one raised,
        the history entries a logger has not taken, then ``on_fit_end``."""
        self._stop()
        if self._benched:
            retried, self._benched = self._benched, set()
            self._emit("on_fit_start", retried, **self._start_arguments)
        for entry in checkpoint.history:
            self._epoch(entry)
        self._emit("on_fit_end", model=model, checkpoint=checkpoint)
        self._close()

    def fail(self, error: BaseException) -> None:
        """After a failed or interrupted fit: ``on_fit_failed``."""
        self._stop()
        self._emit("on_fit_failed", error=error)
        self._close()

    def _stop(self) -> None:
        """Delivers what is queued, then stops the delivery thread; waits for it at most the
        loggers' longest deadline."""
        if self._thread is None or self._queue is None:  # never started (the two are set together)
            return
        self._queue.put(_STOP)
        self._thread.join(max(self._timeout(i) for i in range(len(self._plans))))
        if self._thread.is_alive():
            logger.warning("loggers: the events still queued are dropped (the loggers are slower than their "
                           "event_timeout_s)")
        self._queue = self._thread = None

    def _close(self) -> None:
        for runner in self._runners.values():
            runner.close()
        self._runners = {}

    def _deliver(self) -> None:
        # _stop drops the queue when this thread does not stop in time: the thread then ends
        while (messages := self._queue) is not None and (message := messages.get()) is not _STOP:
            if message.kind is Kind.PROGRESS:
                self._step(message)
            elif message.kind is Kind.EPOCH:
                self._epoch(message.entry)

    def _step(self, message: RankMessage) -> None:
        due = {i for i, (item, _) in enumerate(self._plans)
               if message.time - self._last_step.get(i, float("-inf")) >= item.step_interval_s}
        for index in due:
            self._last_step[index] = message.time
        self._emit("on_step", due, progress=message.progress, loss=message.loss)

    def _epoch(self, entry: dict) -> None:
        """One history entry: first to the loggers that may stop the fit, with their answers,
        then to the others."""
        epoch = int(entry["epoch"])
        due = {i for i in range(len(self._plans)) if epoch not in self._logged[i]}
        taken = self._emit("on_epoch_end", due & self._stoppers, metrics=dict(entry))
        answers = self._emit("should_stop", set(taken), metrics=dict(entry))
        with self._decision:
            for index, answer in answers.items():
                self._answered(index, answer)
            self._decided = max(self._decided, epoch)
            self._decision.notify_all()
        taken.update(self._emit("on_epoch_end", due - self._stoppers, metrics=dict(entry)))
        for index in taken:
            self._logged[index].add(epoch)

    def _answered(self, index: int, answer: Any) -> None:
        """Takes a logger's ``should_stop`` answer (under the decision's lock)."""
        if isinstance(answer, BaseException):
            self.stop_error = self.stop_error or answer
        elif not answer:
            return
        if not self._stop_requested:
            logger.info("logger %s asks the fit to stop at the end of the current epoch",
                        type(self._plans[index][0]).__name__)
        self._stop_requested = True

    def _emit(self, event: str, only: set[int] | None = None, **arguments: Any) -> dict[int, Any]:
        """Calls ``event`` on each logger (of ``only``) still taking events; by logger, what
        the calls that returned gave (a logger without the event counts as returned None)."""
        arguments["run_id"] = self._run_id
        returned: dict[int, Any] = {}
        for index, (item, plan) in enumerate(self._plans):
            if index in self._benched or index in self._abandoned or (only is not None and index not in only):
                continue
            invoke = plan.get(event)
            if invoke is None:
                returned[index] = None
                continue
            runner = self._runners.get(index)
            if runner is None:
                runner = self._runners[index] = _Runner(type(item).__name__)
            value, problem = runner.call(invoke, arguments, self._timeout(index))
            if problem is _TIMED_OUT:
                self._abandon(index, item, event)
            elif isinstance(problem, Exception):
                self._failed(index, item, event, problem)
            else:
                returned[index] = value
        return returned

    def _timeout(self, index: int) -> float:
        return float(self._plans[index][0].event_timeout_s)

    def _abandon(self, index: int, item: Logger, event: str) -> None:
        self._abandoned.add(index)
        logger.warning("logger %s did not return from %s within its event_timeout_s (%.1f s): it is abandoned for "
                       "the rest of this fit and the fit goes on", type(item).__name__, event, self._timeout(index))

    def _failed(self, index: int, item: Logger, event: str, error: Exception) -> None:
        if event == "on_fit_start":
            self._benched.add(index)
        first = (index, event) not in self._warned
        self._warned.add((index, event))
        logger.log(logging.WARNING if first else logging.DEBUG,
                   "logger %s failed in %s (the fit goes on%s): %s: %s", type(item).__name__, event,
                   "; it sits out the fit until it ends, then starts again" if event == "on_fit_start" else "",
                   type(error).__name__, error, exc_info=error if first else None)
