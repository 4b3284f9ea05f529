"""Driver-side loggers on real fits: MLflow against a sqlite store, TensorBoard event files
read back, CSV files, and a logger that raises and cannot be pickled."""

from __future__ import annotations

import csv
import logging
import threading

import mlflow
import pytest
import torch
from mlflow import MlflowClient
from pyspark.ml import Pipeline
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

from spark_torch_est import CSVLogger, Hook, Logger, MLflowLogger, TensorBoardLogger, TorchEstimator
from spark_torch_est.errors import TrainingFailedError
from spark_torch_est.loggers.mlflow_logger import RUN_ID_TAG
from tests.helpers import end_mlflow_download_threads, linear_estimator

pytestmark = pytest.mark.spark


class FailAtEpoch(Hook):
    """Raises when the epoch after ``at`` completed epochs starts (None: never)."""

    def __init__(self) -> None:
        self.at: int | None = None

    def before_train_epoch(self, epoch):
        if epoch == self.at:
            raise RuntimeError("injected failure")


#: This module's estimator: tests.helpers.linear_estimator with these settings.
SETTINGS = {"config": {"lr": 0.05}, "maxEpochs": 2, "seed": 5}


def _metric(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.compat
def test_one_mlflow_run_follows_the_estimator_run_through_fits_and_a_failure(
        spark, linear_df, linear_data, store, monkeypatch):
    uri, client, experiment_id = store
    failing = FailAtEpoch()
    est = linear_estimator(SETTINGS, maxEpochs=4, hooks=[failing],
                           loggers=[MLflowLogger(tracking_uri=uri, experiment_name="tests")])

    est.fit(linear_df, duration="2ep")
    (run,) = client.search_runs([experiment_id])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.data.tags[RUN_ID_TAG] == est.checkpoint.run_id
    assert run.data.params["batchSize"] == "64" and run.data.params["config.lr"] == "0.05"

    failing.at = 3  # the next fit trains epoch 3, then fails
    with pytest.raises(TrainingFailedError, match="injected failure"):
        est.fit(linear_df)
    failed = client.get_run(run_id)
    assert failed.info.status == "FAILED" and "injected failure" in failed.data.tags["spark_torch_est.error"]
    assert [step for step, _ in _metric(client, run_id, "train_loss")] == [1, 2, 3]  # nothing lost
    assert est.progress.epoch == 2

    failing.at = None
    model = est.fit(linear_df)
    assert [r.info.run_id for r in client.search_runs([experiment_id])] == [run_id]  # still one run
    assert client.get_run(run_id).info.status == "FINISHED"
    history = _metric(client, run_id, "train_loss")
    assert [step for step, _ in history] == [1, 2, 3, 3, 4]  # epoch 3 of the failed fit, then trained again
    assert history[2][1] == pytest.approx(history[3][1])  # the same values: CPU, fixed seed
    assert dict(history) == {e["epoch"]: pytest.approx(e["train_loss"]) for e in est.history}
    finished = client.get_run(run_id).data
    assert set(finished.metrics) == {"train_loss"}  # no sampled step loss beside it, no world_size metric
    assert finished.tags["world_size"] == "2"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    logged = mlflow.pytorch.load_model(f"runs:/{run_id}/model")  # the newest model the run logged
    x = torch.from_numpy(linear_data[0][:100])
    with torch.no_grad():
        assert torch.allclose(logged(x), model.torch_model()(x))
    # its requirements are given, not inferred (MLflow's inference is slow), and installable
    requirements = open(mlflow.pyfunc.get_model_dependencies(f"runs:/{run_id}/model")).read().split()
    assert [r.split("==")[0] for r in requirements if not r.startswith("mlflow")] == ["torch", "cloudpickle"]
    assert "+" not in " ".join(requirements) and torch.__version__.split("+")[0] in " ".join(requirements)
    end_mlflow_download_threads()


def test_reset_copy_and_crossvalidator_fits_start_new_runs_and_a_loaded_estimator_continues(
        spark, linear_df, store, tmp_path, monkeypatch):
    uri, client, experiment_id = store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # loggers without a URI log where MLflow is set up
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tests")
    est = linear_estimator(SETTINGS, maxEpochs=1, loggers=[MLflowLogger(log_model=False)])

    est.fit(linear_df)
    (first,) = client.search_runs([experiment_id])
    est.write().overwrite().save(str(tmp_path / "est"))
    loaded = TorchEstimator.load(str(tmp_path / "est")).setMaxEpochs(2)
    loaded.fit(linear_df)  # continues the saved run, so the same MLflow run
    assert [r.info.run_id for r in client.search_runs([experiment_id])] == [first.info.run_id]
    assert [s for s, _ in _metric(client, first.info.run_id, "train_loss")] == [1, 2]

    est.reset().fit(linear_df)
    est.copy().fit(linear_df)
    runs = client.search_runs([experiment_id])
    assert len(runs) == 3 and len({r.data.tags[RUN_ID_TAG] for r in runs}) == 3
    assert all(mlflow.utils.mlflow_tags.MLFLOW_PARENT_RUN_ID not in r.data.tags for r in runs)

    grid = ParamGridBuilder().addGrid(est.batchSize, [128]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=3,
                        evaluator=RegressionEvaluator(labelCol="label", predictionCol="prediction"))
    with mlflow.start_run(run_name="cv") as parent:
        cv.fit(linear_df)  # fits in CrossValidator's own threads
    children = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 3  # two folds and the refit on every row
    assert len({c.data.tags[RUN_ID_TAG] for c in children}) == 3
    assert all(c.info.status == "FINISHED" and c.data.params["batchSize"] == "128" for c in children)
    assert all(_metric(client, c.info.run_id, "train_loss")[0][0] == 1 for c in children)
    names = ["batchSize=128 (refit)", "batchSize=128 (split 1)", "batchSize=128 (split 2)"]
    assert sorted(c.info.run_name for c in children) == names


class Unshippable(Logger):
    """Holds a lock, so it cannot be pickled: the fit works only if it stays on the driver."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def on_epoch_end(self, metrics):
        raise RuntimeError("a bug in a logger")


@pytest.mark.compat
def test_tensorboard_and_csv_record_the_run_while_a_broken_logger_changes_nothing(
        spark, linear_df, tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tensorboard, csv_logger = TensorBoardLogger(str(tmp_path / "tb")), CSVLogger(str(tmp_path / "csv"))
    est = linear_estimator(SETTINGS, loggers=[Unshippable(), tensorboard, csv_logger])
    with caplog.at_level(logging.WARNING, logger="spark_torch_est.loggers.dispatch"):
        est.fit(linear_df, duration="1ep")
        est.fit(linear_df)
    warnings = [r.getMessage() for r in caplog.records if "a bug in a logger" in r.getMessage()]
    assert len(warnings) == 2 and warnings[0].startswith("logger Unshippable failed in on_epoch_end")

    run = est.checkpoint.run_id
    events = EventAccumulator(tensorboard.run_dir(run))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("train_loss")] == [
        (h["epoch"], h["train_loss"]) for h in est.history]
    steps = [e.step for e in events.Scalars("train_loss_step")]
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] <= est.progress.global_step
    with open(f"{csv_logger.run_dir(run)}/metrics.csv", newline="") as f:
        assert [(int(r["epoch"]), float(r["train_loss"])) for r in csv.DictReader(f)] == [
            (h["epoch"], h["train_loss"]) for h in est.history]


def test_loggers_are_saved_with_the_estimator_also_inside_a_pipeline(spark, tmp_path):
    est = linear_estimator(SETTINGS, loggers=[MLflowLogger(tracking_uri="sqlite:///x.db", experiment_name="e",
                                                        log_model=False), CSVLogger("somewhere")])
    Pipeline(stages=[est]).write().overwrite().save(str(tmp_path / "pipeline"))
    loaded = Pipeline.load(str(tmp_path / "pipeline")).getStages()[0]
    mlflow_logger, csv_logger = loaded.loggers
    assert (mlflow_logger.tracking_uri, mlflow_logger.experiment_name, mlflow_logger.log_model) == (
        "sqlite:///x.db", "e", False)
    assert csv_logger.log_dir == "somewhere"
    linear_estimator(SETTINGS).write().overwrite().save(str(tmp_path / "plain"))
    assert TorchEstimator.load(str(tmp_path / "plain")).loggers == []


class Stuck(Logger):
    """Blocks in ``event`` until released (or 120 s pass)."""

    event_timeout_s = 3.0
    step_interval_s = 0.0

    def __init__(self, event: str) -> None:
        self.event, self.release, self.calls = event, threading.Event(), []
        setattr(self, event, self._block)

    def _block(self, **kwargs):
        self.calls.append(self.event)
        self.release.wait(120)

    def on_fit_start(self):
        self.calls.append("on_fit_start")

    def on_step(self):
        self.calls.append("on_step")

    def on_fit_end(self):
        self.calls.append("on_fit_end")


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_stuck_loggers_and_an_unreachable_mlflow_server_are_abandoned_and_fit_returns(spark, linear_df, caplog):
    stuck = [Stuck("on_fit_start"), Stuck("on_step"), Stuck("on_fit_end")]
    down = MLflowLogger(tracking_uri=f"http://127.0.0.1:{_closed_port()}", log_model=False)
    down.event_timeout_s = 60.0  # MLflow's own retries must end well before
    est = linear_estimator(SETTINGS, loggers=[*stuck, down])
    with caplog.at_level(logging.WARNING, logger="spark_torch_est.loggers.dispatch"):
        model = est.fit(linear_df, duration="1ep")
    blocked = [not logger.release.is_set() for logger in stuck]
    for logger in stuck:
        logger.release.set()

    assert blocked == [True, True, True] and model.history == est.history and est.progress.epoch == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for event in ("on_fit_start", "on_step", "on_fit_end"):
        assert any(f"logger Stuck did not return from {event} within its event_timeout_s (3.0 s)" in w
                   for w in warnings)
    assert stuck[1].calls.count("on_step") == 1 and "on_fit_end" not in stuck[1].calls  # abandoned at its step
    assert any(w.startswith("logger MLflowLogger failed in on_fit_start") for w in warnings)  # refused, not hung
    assert not any("MLflowLogger did not return" in w for w in warnings)


class LockedOnce(MLflowLogger):
    """An MLflowLogger whose store refuses its first ``event`` (as a locked sqlite store or a
    server down at the start does)."""

    def __init__(self, event: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.event, self.refused = event, False

    def on_fit_start(self, params, config, run_id):
        self._refuse_once("on_fit_start")
        super().on_fit_start(params, config, run_id)

    def on_epoch_end(self, metrics, run_id):
        self._refuse_once("on_epoch_end")
        super().on_epoch_end(metrics, run_id)

    def _refuse_once(self, event: str) -> None:
        if event == self.event and not self.refused:
            self.refused = True
            raise ConnectionError("database is locked")


@pytest.mark.parametrize("event", ["on_fit_start", "on_epoch_end"])
def test_mlflow_keeps_every_epoch_when_the_store_refuses_a_call(spark, linear_df, store, event):
    uri, client, experiment_id = store
    est = linear_estimator(SETTINGS, maxEpochs=3, loggers=[LockedOnce(event, tracking_uri=uri, experiment_name="tests",
                                                      log_model=False)])
    est.fit(linear_df)
    (run,) = client.search_runs([experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["batchSize"] == "64"
    assert dict(_metric(client, run.info.run_id, "train_loss")) == {
        e["epoch"]: pytest.approx(e["train_loss"]) for e in est.history}  # epochs 1-3, none lost
