"""What the driver shows from the ranks' messages."""

import logging
import time

import pytest

from spark_torch_est import Progress
from spark_torch_est.cluster.messages import RankMessage
from spark_torch_est.core.progress import Target
from spark_torch_est.core.running import fit_logger, running_fit
from spark_torch_est.loggers import view as view_module
from spark_torch_est.loggers.view import DriverView, Mode, progress_mode


def _progress(step, epoch=0, batch=1):
    at = Progress(epoch=epoch, batch_in_epoch=batch, global_step=step, samples=step * 8, sample_in_epoch=batch * 8)
    return RankMessage.for_step(at, 0.25, steps_per_epoch=10)


def _epoch(entry):
    return RankMessage.for_epoch(entry)


def test_progress_lines_count_the_steps_of_this_fit(caplog):
    view = DriverView(True, Progress(epoch=1, global_step=10), Target(epoch=3), samples_per_step=8, mode=Mode.JOB)
    with caplog.at_level(logging.DEBUG, logger="spark_torch_est.progress"):
        view.handle(_progress(14, epoch=1, batch=4))
    view.close()
    lines = [r for r in caplog.records if r.levelno == logging.INFO]
    assert lines[0].getMessage() == "first step after 0.0s; step 4/20 of this fit, epoch 2, loss 0.25"
    debug = [r for r in caplog.records if hasattr(r, "progress")]
    assert debug[0].progress["global_step"] == 14


def test_epochs_and_rank_logs_reach_their_loggers(caplog):
    view = DriverView(False, Progress(), Target(epoch=1), samples_per_step=8)
    with caplog.at_level(logging.INFO):
        view.handle(_epoch({"epoch": 1, "train_loss": 0.5, "val_mae": 0.125}))
        view.handle(RankMessage.for_log(1, logging.WARNING, "user", "hello"))
        view.handle(_progress(1))  # showProgress=False: DEBUG only
    view.close()
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    assert ("spark_torch_est.progress", "epoch 1: train_loss=0.5, val_mae=0.125") in messages
    assert ("spark_torch_est.worker", "[rank 1] user: hello") in messages
    assert not any("of this fit" in m for _, m in messages)


def test_without_logging_set_up_lines_go_to_stderr_while_shown(monkeypatch, capsys):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # as in a plain script or a spark-submit job
    for show in (True, False):
        view = DriverView(show, Progress(), Target(epoch=1), samples_per_step=8, mode=Mode.JOB)
        view.handle(_progress(3, batch=3))
        view.handle(_epoch({"epoch": 1, "train_loss": 0.5}))
        view.close()
        err = capsys.readouterr().err
        expected = ["spark_torch_est: first step after 0.0s; step 3/10 of this fit, epoch 1, loss 0.25",
                    "spark_torch_est: epoch 1: train_loss=0.5"] if show else []
        assert err.splitlines() == expected


def test_the_bar_ends_at_100_percent_with_the_last_epochs_metrics(monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    view = DriverView(True, Progress(), Target(epoch=2), samples_per_step=8, mode=Mode.TERMINAL)
    view.handle(_progress(7, batch=7))
    view.handle(_epoch({"epoch": 1, "train_loss": 0.5}))
    bar = view._bar
    view.finish(Progress(epoch=2, global_step=20), [{"epoch": 1, "train_loss": 0.5}, {"epoch": 2, "train_loss": 0.25}])
    assert (bar.n, bar.total) == (20, 20)
    assert "epoch 2: train_loss=0.25" in str(bar)
    view.close()


def test_while_two_fits_run_at_once_every_line_names_its_fit(caplog):
    """Optuna's n_jobs=2: two fits' lines would interleave with nothing saying whose they are."""
    first = DriverView(True, Progress(), Target(epoch=1), samples_per_step=8, name="lr=0.1", mode=Mode.JOB)
    second = DriverView(True, Progress(), Target(epoch=1), samples_per_step=8, name="lr=0.01", mode=Mode.JOB)
    launcher_log = fit_logger()
    with caplog.at_level(logging.INFO):
        with running_fit("lr=0.1"):
            with running_fit("lr=0.01"):  # (the second fit runs in another thread in real life)
                first.handle(_progress(3, batch=3))
                second.handle(_epoch({"epoch": 1, "train_loss": 0.5}))
                second.handle(RankMessage.for_log(0, logging.WARNING, "user", "hello"))
                launcher_log.warning("relaunching training (%d of %d)", 1, 2)
            second.close()
            first.handle(_epoch({"epoch": 1, "train_loss": 0.25}))  # alone again: no name needed
            launcher_log.warning("relaunching training (%d of %d)", 2, 2)
    first.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == [
        "[lr=0.1] first step after 0.0s; step 3/10 of this fit, epoch 1, loss 0.25",
        "[lr=0.01] epoch 1: train_loss=0.5",
        "[lr=0.01] [rank 0] user: hello", "[lr=0.01] relaunching training (1 of 2)", "epoch 1: train_loss=0.25",
        "relaunching training (2 of 2)"]


def test_a_driver_with_ipython_and_ipykernel_imported_but_no_kernel_running_is_a_job(capsys, monkeypatch):
    """pyspark imports both in every driver where Jupyter is installed (spark-submit on a
    Databricks runtime): that is no notebook, and a log file gets no \\r bar."""
    pytest.importorskip("ipykernel")  # in make test's virtualenv, not every runtime's
    import ipykernel.zmqshell  # noqa: F401
    import IPython  # noqa: F401

    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    assert progress_mode() is Mode.JOB  # stderr is pytest's capture: not a terminal
    view = DriverView(True, Progress(), Target(epoch=1), samples_per_step=8)
    view.handle(_progress(3, batch=3))
    view.close()
    err = capsys.readouterr().err
    assert "\r" not in err and "spark_torch_est: first step after" in err, err


def test_a_terminal_gets_a_bar(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stderr", Tty())
    assert progress_mode() is Mode.TERMINAL


def test_a_job_is_told_at_once_what_the_fit_does_and_then_every_interval_until_the_first_step(monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(view_module, "LINE_EVERY_S", 0.2)
    monkeypatch.setattr(view_module, "_TICK_S", 0.05)
    view = DriverView(True, None, None, samples_per_step=8, mode=Mode.JOB)
    view.phase("launching 2 ranks")
    assert capsys.readouterr().err == "spark_torch_est: launching 2 ranks ...\n"  # at once
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "(0s)" not in capsys.readouterr().err:
        time.sleep(0.05)  # the test waits for the view's own ticker
    view.planned(Progress(), Target(epoch=1))
    view.handle(RankMessage.for_position(Progress(batch_in_epoch=1, global_step=1, samples=8, sample_in_epoch=8), 10))
    view.close()
    assert capsys.readouterr().err.startswith("spark_torch_est: first step after ")
    assert time.monotonic() < deadline


def test_the_first_steps_line_gives_the_whole_fits_time_after_a_long_phase_before_the_launch(monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(view_module, "_EARLIER_PHASES_S", 0.3)
    view = DriverView(True, Progress(), Target(epoch=1), samples_per_step=8, mode=Mode.JOB)
    view.phase("Spark computes the DataFrame's rows")  # a staging job: its own phase before the launch
    time.sleep(0.4)
    view.phase("launching 2 ranks")
    view.handle(_progress(1))
    view.close()
    first = [line for line in capsys.readouterr().err.splitlines() if "first step" in line]
    launch, fit = (float(part.split("s")[0]) for part in first[0].split("after ")[1].split(" (", 1))
    assert launch < 0.3 <= 0.4 <= fit and first[0].endswith("since the fit began); step 1/10 of this fit, epoch 1, "
                                                             "loss 0.25"), first


def test_the_bar_counts_and_rates_are_true_from_the_first_update(monkeypatch, capsys):
    """A bar made at the first progress message with 10 steps done read ``289262.34step/s``."""
    view = DriverView(True, Progress(), Target(epoch=12), samples_per_step=8, mode=Mode.TERMINAL)
    view.phase("launching 2 ranks")
    time.sleep(0.3)  # the ranks start (the time before the first step is no training)
    view.handle(RankMessage.for_position(Progress(batch_in_epoch=1, global_step=1, samples=8, sample_in_epoch=8), 10))
    bar = view._bar
    first = bar.format_dict
    assert (first["n"], first["total"]) == (1, 120)
    assert not first["rate"] and first["n"] - first["initial"] == 0  # no rate before a second reading
    time.sleep(0.5)
    view.handle(_progress(6, batch=6))
    stats = bar.format_dict
    rate = (stats["n"] - stats["initial"]) / stats["elapsed"] if stats["rate"] is None else stats["rate"]
    assert stats["n"] == 6 and 2 < rate < 20  # 5 steps in ~0.5 s
    view.close()
