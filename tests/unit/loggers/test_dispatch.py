"""Loggers without Spark: keyword dispatch, throttled steps, each epoch once, a raising
logger, one event at a time, and the CSV files."""

from __future__ import annotations

import csv
import json
import logging
import threading
import time

import numpy as np
import pytest
import torch

from spark_torch_est import CSVLogger, Logger, TorchEstimator
from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.cluster.messages import Kind, RankMessage
from spark_torch_est.core.progress import Progress
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.loggers.dispatch import LoggerDispatch
from tests.helpers import features_schema


class Recorder(Logger):
    """Records (event, arguments, thread) for every event."""

    step_interval_s = 0.0

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, int]] = []

    def _record(self, event: str, **arguments) -> None:
        self.calls.append((event, arguments, threading.get_ident()))

    def on_fit_start(self, config, run_id):
        self._record("on_fit_start", config=config, run_id=run_id)

    def on_step(self, loss, progress):
        self._record("on_step", loss=loss, progress=progress)

    def on_epoch_end(self, metrics):
        self._record("on_epoch_end", metrics=metrics)

    def on_fit_end(self, **kwargs):
        self._record("on_fit_end", **kwargs)

    def on_fit_failed(self, error):
        self._record("on_fit_failed", error=error)

    def events(self, name: str) -> list[dict]:
        return [arguments for event, arguments, _ in self.calls if event == name]


class Raising(Logger):
    def on_fit_start(self):
        raise RuntimeError("tracking server down")

    def on_step(self):
        raise RuntimeError("never called: benched after on_fit_start")


class RaisingLater(Logger):
    step_interval_s = 0.0

    def on_step(self, progress):
        raise ValueError(f"bad step {progress.global_step}")

    def on_fit_end(self):
        raise ValueError("cannot finish")


def checkpoint(epochs: int, global_step: int = 0, history: list[dict] | None = None) -> Checkpoint:
    return Checkpoint.build(
        run_id="r", fit_id="f", progress=Progress(epoch=epochs, global_step=global_step),
        history=history if history is not None else [{"epoch": e, "train_loss": 1.0 / e} for e in range(1, epochs + 1)],
        partial_loss=(0.0, 0.0),
        epoch_rows=10, world_size=1, data_source="spark", seed=0, optimizer_made=[], output_shape=[1],
        label_kind="float", input_schema=features_schema(3).to_dict(),
        input_rows=[[3]],
        model={}, optimizer={}, scheduler=None, rng=[], hooks={},
    )


def progress_message(step: int, when: float) -> RankMessage:
    return RankMessage(Kind.PROGRESS, when, progress=Progress(epoch=0, batch_in_epoch=step, global_step=step),
                       steps_per_epoch=100, loss=1.0 / step)


def epoch_message(epoch: int) -> RankMessage:
    return RankMessage.for_epoch({"epoch": epoch, "train_loss": 1.0 / epoch})


def run_fit(loggers, messages, final: Checkpoint, start: Progress = Progress(), run_id: str = "run-1"):
    dispatch = LoggerDispatch(loggers, run_id, start)
    dispatch.start({"batchSize": 8}, {"lr": 0.1}, start)
    for message in messages:
        dispatch.handle(message)
    dispatch.finish("the model", final)


def test_each_event_gets_the_arguments_it_names_and_the_run_id():
    recorder = Recorder()
    run_fit([recorder], [progress_message(1, 0.0), epoch_message(1)], checkpoint(1, global_step=5))

    assert [event for event, _, _ in recorder.calls] == ["on_fit_start", "on_step", "on_epoch_end", "on_fit_end"]
    assert recorder.events("on_fit_start") == [{"config": {"lr": 0.1}, "run_id": "run-1"}]
    step = recorder.events("on_step")[0]
    assert step["loss"] == 1.0 and step["progress"] == Progress(epoch=0, batch_in_epoch=1, global_step=1)
    assert recorder.events("on_epoch_end") == [{"metrics": {"epoch": 1, "train_loss": 1.0}}]
    end = recorder.events("on_fit_end")[0]
    assert end["model"] == "the model" and end["checkpoint"].progress.global_step == 5 and end["run_id"] == "run-1"


def test_steps_are_throttled_per_logger():
    class EverySecond(Recorder):
        step_interval_s = 1.0

    slow, fast = EverySecond(), Recorder()
    times = [100.0, 100.3, 101.0, 101.2, 102.5]
    run_fit([slow, fast], [progress_message(i + 1, t) for i, t in enumerate(times)], checkpoint(0))

    assert [s["progress"].global_step for s in slow.events("on_step")] == [1, 3, 5]
    assert [s["progress"].global_step for s in fast.events("on_step")] == [1, 2, 3, 4, 5]


def test_each_epoch_is_logged_once_live_or_from_the_history():
    recorder = Recorder()
    # epochs 1 and 2 arrive live (2 twice, as after a relaunch); 3 only with the checkpoint
    run_fit([recorder], [epoch_message(1), epoch_message(2), epoch_message(2)], checkpoint(3))
    assert [m["metrics"]["epoch"] for m in recorder.events("on_epoch_end")] == [1, 2, 3]


def test_without_live_messages_the_new_history_entries_are_logged_when_fit_returns():
    recorder = Recorder()  # as under Spark Connect: no channel, no messages
    run_fit([recorder], [], checkpoint(4), start=Progress(epoch=2, global_step=20))
    assert [m["metrics"]["epoch"] for m in recorder.events("on_epoch_end")] == [3, 4]
    assert recorder.events("on_step") == []


def test_a_raising_logger_is_warned_about_and_the_others_go_on(caplog):
    recorder = Recorder()
    with caplog.at_level(logging.DEBUG, logger="spark_torch_est.loggers.dispatch"):
        run_fit([Raising(), RaisingLater(), recorder], [progress_message(1, 0.0), progress_message(2, 1.0)],
                checkpoint(1))

    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(":")[0] for r in warnings] == [
        "logger Raising failed in on_fit_start (the fit goes on; it sits out the fit until it ends, then starts again)",
        "logger RaisingLater failed in on_step (the fit goes on)",
        "logger RaisingLater failed in on_fit_end (the fit goes on)",
    ]
    assert "tracking server down" in warnings[0].getMessage() and warnings[0].exc_info is not None
    assert any("bad step 2" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert [event for event, _, _ in recorder.calls] == [
        "on_fit_start", "on_step", "on_step", "on_epoch_end", "on_fit_end"]


def test_a_failed_fit_reaches_on_fit_failed_after_the_queued_messages():
    recorder = Recorder()
    dispatch = LoggerDispatch([recorder], "run-1", Progress())
    dispatch.start({}, {}, Progress())
    dispatch.handle(epoch_message(1))
    error = RuntimeError("rank 1 died")
    dispatch.fail(error)
    assert [event for event, _, _ in recorder.calls] == ["on_fit_start", "on_epoch_end", "on_fit_failed"]
    assert recorder.events("on_fit_failed") == [{"error": error}]


def test_events_from_many_threads_reach_a_logger_one_at_a_time():
    class Exclusive(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.busy = threading.Lock()
            self.overlaps = 0

        def on_step(self, loss, progress):
            if not self.busy.acquire(blocking=False):
                self.overlaps += 1
                return
            time.sleep(0.0005)
            super().on_step(loss, progress)
            self.busy.release()

    logger = Exclusive()
    dispatch = LoggerDispatch([logger], "run-1", Progress())
    dispatch.start({}, {}, Progress())

    def send(offset: int) -> None:
        for i in range(50):
            dispatch.handle(progress_message(offset * 50 + i + 1, 0.0))

    senders = [threading.Thread(target=send, args=(t,)) for t in range(8)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    dispatch.finish(None, checkpoint(0))

    assert logger.overlaps == 0 and len(logger.events("on_step")) == 400
    threads = {thread for _, _, thread in logger.calls}
    assert len(threads) == 1 and threads != {threading.get_ident()}  # the logger's own thread, never fit()'s


class Stuck(Recorder):
    """Blocks in ``event`` until released (or 30 s pass)."""

    event_timeout_s = 0.5

    def __init__(self, event: str) -> None:
        super().__init__()
        self.event, self.release = event, threading.Event()

    def _record(self, event: str, **arguments) -> None:
        super()._record(event, **arguments)
        if event == self.event:
            self.release.wait(30)


@pytest.mark.parametrize("event", ["on_fit_start", "on_step", "on_epoch_end", "on_fit_end"])
def test_a_stuck_logger_is_abandoned_with_a_warning_and_the_others_go_on(caplog, event):
    stuck, recorder = Stuck(event), Recorder()
    with caplog.at_level(logging.WARNING, logger="spark_torch_est.loggers.dispatch"):
        run_fit([stuck, recorder], [progress_message(1, 0.0), epoch_message(1), progress_message(2, 1.0)],
                checkpoint(2))
    still_stuck = not stuck.release.is_set()
    stuck.release.set()
    assert still_stuck  # run_fit returned while the logger was still blocked
    assert [e for e, _, _ in stuck.calls][-1] == event  # nothing after the stuck event
    assert [e for e, _, _ in recorder.calls] == [
        "on_fit_start", "on_step", "on_epoch_end", "on_step", "on_epoch_end", "on_fit_end"]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"logger Stuck did not return from {event} within its event_timeout_s (0.5 s)" in warning


def test_an_epoch_is_marked_logged_only_when_the_logger_took_it():
    class Flaky(Recorder):
        """Its first on_epoch_end raises (as a locked sqlite store does)."""

        def on_epoch_end(self, metrics):
            if not self.events("failed"):
                self._record("failed")
                raise RuntimeError("database is locked")
            super().on_epoch_end(metrics)

    flaky = Flaky()
    run_fit([flaky], [epoch_message(1), epoch_message(2)], checkpoint(3))
    assert [m["metrics"]["epoch"] for m in flaky.events("on_epoch_end")] == [2, 1, 3]


def test_a_logger_whose_fit_start_failed_starts_again_when_the_fit_ends_and_logs_what_it_missed():
    class DownAtStart(Recorder):
        def on_fit_start(self, config, run_id):
            if not self.events("failed"):
                self._record("failed")
                raise ConnectionError("tracking server down")
            super().on_fit_start(config, run_id)

    late = DownAtStart()
    run_fit([late], [progress_message(1, 0.0), epoch_message(1)], checkpoint(2))
    assert [e for e, _, _ in late.calls] == ["failed", "on_fit_start", "on_epoch_end", "on_epoch_end", "on_fit_end"]
    assert [m["metrics"]["epoch"] for m in late.events("on_epoch_end")] == [1, 2]


@pytest.mark.parametrize("value", [-1.0, float("inf"), "5", None, True])
def test_a_bad_event_timeout_is_refused(value):
    recorder = Recorder()
    recorder.event_timeout_s = value
    with pytest.raises(InvalidInputError, match=f"loggers\\[0\\].event_timeout_s must be a number of seconds "
                                                f">= 0, got {value!r}"):
        TorchEstimator(loggers=[recorder])


def test_bad_loggers_are_refused_when_the_estimator_is_made():
    class Misspelled(Logger):
        def on_epoch_end(self, metric):
            pass

    with pytest.raises(InvalidInputError, match="on_epoch_end\\(\\) asks for unknown argument 'metric'"):
        TorchEstimator(loggers=[Misspelled()])
    with pytest.raises(InvalidInputError, match="loggers\\[1\\] must be a spark_torch_est.loggers.Logger"):
        TorchEstimator(loggers=[Recorder(), print])
    with pytest.raises(InvalidInputError, match="loggers\\[0\\]"):
        TorchEstimator().setLoggers([Misspelled])  # the class, not an instance
    assert len(TorchEstimator(loggers=Recorder()).loggers) == 1


def test_copy_deep_copies_the_loggers():
    recorder = Recorder()
    recorder.calls.append(("seen", {}, 0))
    est = TorchEstimator(loggers=[recorder])
    copied = est.copy().loggers[0]
    assert copied is not recorder and copied.calls == recorder.calls
    copied.calls.clear()
    assert recorder.calls  # the copy logs on its own


def test_csv_logger_adds_columns_as_they_appear(tmp_path):
    logger = CSVLogger(str(tmp_path))
    dispatch = LoggerDispatch([logger], "0123456789abcdef", Progress())
    dispatch.start({"batchSize": 8}, {"lr": 0.1}, Progress())
    dispatch.handle(RankMessage.for_epoch({"epoch": 1, "train_loss": 0.5}))
    dispatch.handle(progress_message(7, 0.0))
    final = checkpoint(2, history=[{"epoch": 1, "train_loss": 0.5}, {"epoch": 2, "train_loss": 0.25, "val_loss": 0.3}])
    dispatch.finish(None, final)

    folder = tmp_path / "0123456789ab"
    with open(folder / "metrics.csv", newline="") as f:
        assert list(csv.DictReader(f)) == [{"epoch": "1", "train_loss": "0.5", "val_loss": ""},
                                           {"epoch": "2", "train_loss": "0.25", "val_loss": "0.3"}]
    with open(folder / "steps.csv", newline="") as f:
        assert list(csv.reader(f)) == [["global_step", "epoch", "train_loss_step"], ["7", "0", str(1 / 7)]]
    assert json.loads((folder / "params.json").read_text()) == {"batchSize": 8, "config.lr": 0.1}


def test_a_raising_loggers_warning_carries_its_traceback(caplog):
    with caplog.at_level(logging.WARNING, logger="spark_torch_est.loggers.dispatch"):
        run_fit([RaisingLater()], [progress_message(1, 0.0)], checkpoint(1))

    (warning, _) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "failed in on_step" in warning.getMessage()
    assert warning.exc_info[0] is ValueError
    traceback_text = logging.Formatter().formatException(warning.exc_info)
    assert "in on_step" in traceback_text and "ValueError: bad step 1" in traceback_text


class StopAt(Recorder):
    """Asks the fit to stop from epoch ``epoch`` on, with ``answer``."""

    def __init__(self, epoch: int, answer=True) -> None:
        super().__init__()
        self.epoch, self.answer = epoch, answer

    def should_stop(self, metrics):
        self._record("should_stop", metrics=metrics)
        return self.answer if metrics["epoch"] >= self.epoch else False


def test_a_logger_that_may_stop_is_answered_for_after_its_on_epoch_end():
    recorder, stopper = Recorder(), StopAt(2)
    dispatch = LoggerDispatch([recorder, stopper], "run-1", Progress())
    assert dispatch.stop_wait_s == 2 * stopper.event_timeout_s
    dispatch.start({}, {}, Progress())
    dispatch.handle(epoch_message(1))
    assert dispatch.stop_asked(1, timeout=10) is False
    dispatch.handle(epoch_message(2))
    assert dispatch.stop_asked(2, timeout=10) is True
    dispatch.finish("the model", checkpoint(2))
    assert [e for e, _, _ in stopper.calls] == ["on_fit_start"] + ["on_epoch_end", "should_stop"] * 2 + ["on_fit_end"]
    assert [e for e, _, _ in recorder.calls] == ["on_fit_start", "on_epoch_end", "on_epoch_end", "on_fit_end"]
    assert [m["metrics"]["epoch"] for m in recorder.events("on_epoch_end")] == [1, 2]
    assert dispatch.stop_error is None  # True stops the fit; fit returns as usual


class SlowTracker(Recorder):
    """A tracker whose ``event`` blocks until released (longer than an epoch takes)."""

    event_timeout_s = 60.0

    def __init__(self, event: str) -> None:
        super().__init__()
        self.event, self.release = event, threading.Event()

    def on_step(self, loss, progress):
        super().on_step(loss, progress)
        if self.event == "on_step":
            self.release.wait(60)

    def on_epoch_end(self, metrics):
        super().on_epoch_end(metrics)
        if self.event == "on_epoch_end":
            self.release.wait(60)


@pytest.mark.parametrize("event, stop_at", [("on_step", 1), ("on_epoch_end", 2)])
def test_a_stop_request_is_answered_without_waiting_for_a_slow_tracker(event, stop_at):
    tracker, stopper = SlowTracker(event), StopAt(stop_at)
    dispatch = LoggerDispatch([tracker, stopper], "run-1", Progress())
    dispatch.start({}, {}, Progress())
    try:
        dispatch.handle(progress_message(1, when=1.0))
        for epoch in range(1, stop_at + 1):
            dispatch.handle(epoch_message(epoch))
            started = time.monotonic()
            assert dispatch.stop_asked(epoch, timeout=5) is (epoch == stop_at)  # this epoch's answer, in time
            assert time.monotonic() - started < 5
        assert [e for e, _, _ in tracker.calls].count(event) == 1 and tracker.calls[-1][0] == event  # still in it
    finally:
        tracker.release.set()
    dispatch.finish("the model", checkpoint(stop_at))
    assert [m["metrics"]["epoch"] for m in tracker.events("on_epoch_end")] == list(range(1, stop_at + 1))


@pytest.mark.parametrize("answer", ["no", {"stop": False}, RuntimeError, 1])
def test_an_answer_that_is_not_true_false_or_an_exception_is_warned_about_naming_the_logger(answer, caplog):
    dispatch = LoggerDispatch([StopAt(1, answer=answer)], "run-1", Progress())
    dispatch.start({}, {}, Progress())
    dispatch.handle(epoch_message(1))
    with caplog.at_level(logging.WARNING, logger="spark_torch_est.loggers.dispatch"):
        assert dispatch.stop_asked(1, timeout=10) is False  # junk does not stop the fit
    dispatch.finish("the model", checkpoint(1))
    assert dispatch.stop_error is None
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warning.startswith("logger StopAt: should_stop() returned ")
    assert "expected True (stop), False or None (go on), or an exception instance for fit to raise" in warning
    assert "a bug in spark_torch_est" not in caplog.text


def test_an_exception_answer_stops_and_is_kept_for_fit_to_raise():
    pruned = RuntimeError("pruned")
    dispatch = LoggerDispatch([StopAt(1, answer=pruned)], "run-1", Progress())
    dispatch.start({}, {}, Progress())
    dispatch.handle(epoch_message(1))
    assert dispatch.stop_asked(1, timeout=10) is True
    dispatch.finish("the model", checkpoint(1))
    assert dispatch.stop_error is pruned


def test_without_a_logger_that_may_stop_no_question_is_asked():
    assert LoggerDispatch([Recorder()], "run-1", Progress()).stop_wait_s is None


def test_a_stop_answer_that_does_not_come_in_time_goes_on_and_counts_at_the_next_question():
    class SlowStop(StopAt):
        event_timeout_s = 30.0

        def __init__(self) -> None:
            super().__init__(1)
            self.release = threading.Event()

        def should_stop(self, metrics):
            self.release.wait(30)
            return super().should_stop(metrics)

    stopper = SlowStop()
    dispatch = LoggerDispatch([stopper], "run-1", Progress())
    dispatch.start({}, {}, Progress())
    dispatch.handle(epoch_message(1))
    started = time.monotonic()
    assert dispatch.stop_asked(1, timeout=0.2) is False  # the fit goes on
    assert time.monotonic() - started < 5
    stopper.release.set()
    dispatch.handle(epoch_message(2))
    assert dispatch.stop_asked(2, timeout=10) is True  # epoch 1's late answer stops the fit at epoch 2's end
    dispatch.finish("the model", checkpoint(2))


def test_without_live_messages_an_exception_answer_is_still_raised_by_fit():
    pruned = RuntimeError("pruned")
    dispatch = LoggerDispatch([StopAt(2, answer=pruned)], "run-1", Progress())
    dispatch.start({}, {}, Progress())
    dispatch.finish("the model", checkpoint(3))
    assert dispatch.stop_error is pruned


@pytest.mark.parametrize("answer", [torch.tensor(True), torch.tensor([True]), np.array(True)])
def test_a_one_bool_tensor_answer_stops_the_fit_as_true_does(answer):
    dispatch = LoggerDispatch([StopAt(1, answer=answer)], "run-1", Progress())
    dispatch.start({}, {}, Progress())
    dispatch.handle(epoch_message(1))
    assert dispatch.stop_asked(1, timeout=10) is True
    dispatch.finish("the model", checkpoint(1))
