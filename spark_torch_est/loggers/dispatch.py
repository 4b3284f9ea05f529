"""[driver] Delivers one fit's events to the estimator's loggers, each within a deadline.

The ranks' messages arrive, decoded, on the channel's reader threads; they are queued
here and handed to the loggers by one delivery thread, so a slow tracking server never
holds up the channel (which also carries the checkpoint). Every event, ``on_fit_start``,
``on_fit_end`` and ``on_fit_failed`` included, runs in the logger's own thread while the
caller waits at most the logger's ``event_timeout_s``: a logger that does not return by
then is abandoned for the rest of the fit with a warning (its thread is left to finish
on its own), so no logger can keep ``fit`` from starting the job or from returning. A
logger's events run one at a time, in order.

A logger that overrides ``should_stop`` may stop the fit: such loggers take the messages on
a delivery thread of their own (each epoch's entry, then the question), apart from the
other loggers, so a slow tracker never delays an answer; :meth:`LoggerDispatch.stop_asked`
(which the channel calls when rank 0 asks at an epoch end) waits, within the deadlines, for
that epoch's answer. An answer is True, False (or None), or an exception for ``fit`` to
raise; anything else is warned about, naming the logger, and does not stop the fit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.cluster.messages import Kind, RankMessage
from spark_torch_est.core.progress import Progress
from spark_torch_est.errors import described
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
        self._stoppers = {i for i, (_, plan) in enumerate(self._plans) if "should_stop" in plan}
        #: The loggers that may stop the fit, and the others: each group takes the messages on a
        #: delivery thread of its own (a queue and its thread per group while the fit runs).
        self._groups = [group for group in (self._stoppers, set(range(len(self._plans))) - self._stoppers) if group]
        self._lanes: list[tuple[queue.SimpleQueue, threading.Thread, threading.Event]] = []
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
        for group in self._groups:
            messages: queue.SimpleQueue = queue.SimpleQueue()
            dropped = threading.Event()
            thread = threading.Thread(target=self._deliver, args=(messages, group, dropped), daemon=True,
                                      name="spark_torch_est-loggers" + ("-stop" if group is self._stoppers else ""))
            thread.start()
            self._lanes.append((messages, thread, dropped))

    def handle(self, message: RankMessage) -> None:
        """Queues one of the ranks' messages for the loggers (called from channel threads)."""
        for messages, _, _ in self._lanes:
            messages.put(message)

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
        """Delivers what is queued, then stops the delivery threads; waits for them at most
        the loggers' longest deadline, together."""
        lanes, self._lanes = self._lanes, []
        if not lanes:  # never started
            return
        for messages, _, _ in lanes:
            messages.put(_STOP)
        deadline = time.monotonic() + max(self._timeout(i) for i in range(len(self._plans)))
        for _, thread, dropped in lanes:
            thread.join(max(deadline - time.monotonic(), 0.0))
            dropped.set()  # a thread still running ends after its current event
        if any(thread.is_alive() for _, thread, _ in lanes):
            logger.warning("loggers: the events still queued are dropped (the loggers are slower than their "
                           "event_timeout_s)")

    def _close(self) -> None:
        for runner in self._runners.values():
            runner.close()
        self._runners = {}

    def _deliver(self, messages: queue.SimpleQueue, group: set[int], dropped: threading.Event) -> None:
        """Hands the queued messages to the loggers of ``group``, one at a time, until told
        to stop, or ``dropped`` by :meth:`_stop` when it did not stop in time."""
        while (message := messages.get()) is not _STOP and not dropped.is_set():
            if message.kind is Kind.PROGRESS:
                self._step(message, group)
            elif message.kind is Kind.EPOCH:
                self._epoch(message.entry, group)

    def _step(self, message: RankMessage, group: set[int]) -> None:
        due = {i for i in group if message.time - self._last_step.get(i, float("-inf"))
               >= self._plans[i][0].step_interval_s}
        for index in due:
            self._last_step[index] = message.time
        self._emit("on_step", due, progress=message.progress, loss=message.loss)

    def _epoch(self, entry: dict, group: set[int] | None = None) -> None:
        """One history entry to the loggers of ``group`` (None: all, those that may stop the
        fit first); the loggers that may stop the fit answer right after taking it."""
        if group is None:
            for each in self._groups:
                self._epoch(entry, each)
            return
        epoch = int(entry["epoch"])
        due = {i for i in group if epoch not in self._logged[i]}
        taken = self._emit("on_epoch_end", due, metrics=dict(entry))
        if group is self._stoppers:
            answers = self._emit("should_stop", set(taken), metrics=dict(entry))
            with self._decision:
                for index, answer in answers.items():
                    self._answered(index, answer)
                self._decided = max(self._decided, epoch)
                self._decision.notify_all()
        for index in taken:
            self._logged[index].add(epoch)

    def _answered(self, index: int, answer: Any) -> None:
        """Takes a logger's ``should_stop`` answer (under the decision's lock): True stops the
        fit, an exception stops it for ``fit`` to raise, False or None goes on; anything else
        is warned about and goes on."""
        if _is_one_bool(answer):  # a 0-d or one-element bool tensor (a torch comparison) is a bool
            answer = bool(answer.item())
        if isinstance(answer, BaseException):
            self.stop_error = self.stop_error or answer
        elif answer is None or isinstance(answer, (bool, np.bool_)):
            if not answer:
                return
        else:
            item = self._plans[index][0]
            if (index, "should_stop answer") not in self._warned:
                self._warned.add((index, "should_stop answer"))
                logger.warning("logger %s: should_stop() returned %s; expected True (stop), False or None (go on), or "
                               "an exception instance for fit to raise (not its class): the fit goes on",
                               type(item).__name__, described(answer))
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



def _is_one_bool(value: Any) -> bool:
    """Whether ``value`` is a tensor or numpy array holding one bool (a comparison's result)."""
    if isinstance(value, np.ndarray):
        return value.dtype == np.bool_ and value.size == 1
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.numel() == 1
