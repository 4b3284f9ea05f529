"""What the driver shows from the ranks' messages."""

import logging

from spark_torch_est import Progress
from spark_torch_est.cluster.messages import RankMessage
from spark_torch_est.core.progress import Target
from spark_torch_est.core.running import fit_logger, running_fit
from spark_torch_est.loggers.view import DriverView


def _progress(step, epoch=0, batch=1):
    at = Progress(epoch=epoch, batch_in_epoch=batch, global_step=step, samples=step * 8, sample_in_epoch=batch * 8)
    return RankMessage.for_step(at, 0.25, steps_per_epoch=10)


def _epoch(entry):
    return RankMessage.for_epoch(entry)


def test_progress_lines_count_the_steps_of_this_fit(caplog):
    view = DriverView(True, Progress(epoch=1, global_step=10), Target(epoch=3), samples_per_step=8)
    view._interactive = False  # log lines, as outside a terminal
    with caplog.at_level(logging.DEBUG, logger="spark_torch_est.progress"):
        view.handle(_progress(14, epoch=1, batch=4))
    view.close()
    lines = [r for r in caplog.records if r.levelno == logging.INFO]
    assert lines[0].getMessage() == "step 4/20 of this fit, epoch 2, loss 0.25"
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
        view = DriverView(show, Progress(), Target(epoch=1), samples_per_step=8)
        view._interactive = False
        view.handle(_progress(3, batch=3))
        view.handle(_epoch({"epoch": 1, "train_loss": 0.5}))
        view.close()
        err = capsys.readouterr().err
        expected = ["spark_torch_est: step 3/10 of this fit, epoch 1, loss 0.25",
                    "spark_torch_est: epoch 1: train_loss=0.5"] if show else []
        assert err.splitlines() == expected


def test_the_bar_ends_at_100_percent_with_the_last_epochs_metrics(monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    view = DriverView(True, Progress(), Target(epoch=2), samples_per_step=8)
    view._interactive = True
    view.handle(_progress(7, batch=7))
    view.handle(_epoch({"epoch": 1, "train_loss": 0.5}))
    bar = view._bar
    view.finish(Progress(epoch=2, global_step=20), [{"epoch": 1, "train_loss": 0.5}, {"epoch": 2, "train_loss": 0.25}])
    assert (bar.n, bar.total) == (20, 20)
    assert "epoch 2: train_loss=0.25" in str(bar)
    view.close()


def test_while_two_fits_run_at_once_every_line_names_its_fit(caplog):
    """Optuna's n_jobs=2: two fits' lines would interleave with nothing saying whose they are."""
    first = DriverView(True, Progress(), Target(epoch=1), samples_per_step=8, name="lr=0.1")
    second = DriverView(True, Progress(), Target(epoch=1), samples_per_step=8, name="lr=0.01")
    first._interactive = second._interactive = False
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
        "[lr=0.1] step 3/10 of this fit, epoch 1, loss 0.25", "[lr=0.01] epoch 1: train_loss=0.5",
        "[lr=0.01] [rank 0] user: hello", "[lr=0.01] relaunching training (1 of 2)", "epoch 1: train_loss=0.25",
        "relaunching training (2 of 2)"]
