"""[driver] MLflowLogger: one MLflow run per estimator run, spanning its fits."""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from spark_torch_est.core.schema import FEATURES_LAYOUT
from spark_torch_est.core.support import installed
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.loggers.base import Logger, scalars, tracked_params

if TYPE_CHECKING:
    from spark_torch_est.model import TorchModel

__all__ = ["MLflowLogger", "RUN_ID_TAG", "REQUEST_SETTINGS", "input_example"]

#: The MLflow run tag that holds the estimator run's id.
RUN_ID_TAG = "spark_torch_est.run_id"
_PARENT_TAG = "mlflow.parentRunId"
_ERROR_TAG = "spark_torch_est.error"
_WORLD_SIZE = "world_size"
_MAX_PARAM = 500
_URI_LOCK = threading.Lock()
#: MLflow's HTTP retry settings while a logger event runs, unless the process sets them:
#: a request to a server that is down fails after two short retries, where MLflow's defaults
#: retry for minutes.
REQUEST_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
_REQUESTS_LOCK = threading.Lock()
_requests_users = 0
_requests_set: list[str] = []


_Event = TypeVar("_Event", bound=Callable[..., Any])


@contextmanager
def _bounded_requests() -> Iterator[None]:
    """Applies :data:`REQUEST_SETTINGS` that the process has not set, while any logger event
    runs (MLflow reads them at each request; other threads' MLflow calls see them meanwhile)."""
    global _requests_users
    with _REQUESTS_LOCK:
        if _requests_users == 0:
            _requests_set[:] = [name for name in REQUEST_SETTINGS if name not in os.environ]
            os.environ.update({name: REQUEST_SETTINGS[name] for name in _requests_set})
        _requests_users += 1
    try:
        yield
    finally:
        with _REQUESTS_LOCK:
            _requests_users -= 1
            if _requests_users == 0:
                for name in _requests_set:
                    os.environ.pop(name, None)


def _bounded(event: _Event) -> _Event:
    @functools.wraps(event)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _bounded_requests():
            return event(*args, **kwargs)

    return run  # type: ignore[return-value]


@dataclass
class _Active:
    """The MLflow side of one fit."""

    client: Any
    run_id: str
    experiment_id: str


class MLflowLogger(Logger):
    """Logs each estimator run as one MLflow run: a second ``fit`` continues it (metric
    steps go on), ``reset()``, ``copy()`` and each ``CrossValidator`` fit start a new one.

    Params and config (as ``config.<key>``) are logged as MLflow params at the run's first
    fit (later fits add new names only: MLflow params cannot change), each history entry
    as metrics with ``step=epoch`` (its ``world_size`` as the tag ``world_size``), and at the
    end of each fit the model with ``mlflow.pytorch.log_model``. No per-step metric: the
    loss rank 0 reports while it trains is a sample of a few points (a throttled stream),
    which MLflow's run summary would show as the run's loss beside the epoch's mean. When
    an MLflow run is active where ``fit`` is called (or, as for ``CrossValidator``'s threads,
    in another thread of the driver), the new run is nested under it. A failed fit marks the
    run FAILED (KILLED for Ctrl-C).

    Args:
        tracking_uri: Where to log (default None: ``MLFLOW_TRACKING_URI`` or
            ``mlflow.set_tracking_uri``, else MLflow's local default, ``sqlite:///mlflow.db``
            in the working directory).
        experiment_name: Experiment, created if missing (default None: the parent run's,
            else MLflow's current one: ``mlflow.set_experiment``, ``MLFLOW_EXPERIMENT_NAME``,
            a Databricks notebook's, else ``Default``).
        run_name: Name of the MLflow run (default None: MLflow picks one). A fit of a
            ``CrossValidator`` or ``TrainValidationSplit`` adds its param map and fold,
            or ``refit`` (``"batchSize=32 (fold 2)"``).
        log_model: Log the model at the end of each fit (default True).
        artifact_location: Where an experiment this logger creates keeps its artifacts
            (default None: the tracking server's default, ``./mlruns`` for a local store).
        pip_requirements: The logged model's pip requirements (default None: ``torch`` and
            ``cloudpickle`` pinned to the driver's versions, without a local version label
            such as ``+cpu``). Given explicitly, so MLflow does not infer them, which takes
            seconds per logged model; list what else your model's code imports.

    Raises:
        InvalidInputError: mlflow is not installed.
    """

    def __init__(self, tracking_uri: str | None = None, experiment_name: str | None = None,
                 run_name: str | None = None, log_model: bool = True, artifact_location: str | None = None,
                 pip_requirements: list[str] | None = None) -> None:
        if importlib.util.find_spec("mlflow") is None:
            raise InvalidInputError("MLflowLogger needs mlflow: pip install 'spark-torch-est[mlflow]'")
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.log_model = log_model
        self.artifact_location = artifact_location
        self.pip_requirements = pip_requirements
        self._active: dict[str, _Active] = {}  # estimator run id -> this fit's MLflow run

    @_bounded
    def on_fit_start(self, params: dict, config: dict, run_id: str, name: str | None = None) -> None:
        """Finds the estimator run's MLflow run, or starts one; logs new params."""
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = MlflowClient(self.tracking_uri)
        parent = self._parent_run()
        experiment_id = self._experiment_id(client, parent)
        found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1)
        if found:
            run = found[0]
            client.update_run(run.info.run_id, status="RUNNING")
        else:
            tags = {RUN_ID_TAG: run_id, **({_PARENT_TAG: parent.info.run_id} if parent is not None else {})}
            run_name = " ".join(part for part in (self.run_name, name) if part) or None
            run = client.create_run(experiment_id, tags=tags, run_name=run_name)
        new = [Param(key, _text(value)) for key, value in tracked_params(params, config).items()
               if key not in run.data.params]
        for start in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run.info.run_id, params=new[start:start + 100])
        self._active[run_id] = _Active(client, run.info.run_id, experiment_id)

    @_bounded
    def on_epoch_end(self, metrics: dict, run_id: str) -> None:
        """Logs a history entry's numbers at ``step=epoch``; its ``world_size`` (the ranks
        that trained the epoch: fewer in a shrunk elastic run) as a tag, not a metric."""
        from mlflow.entities import Metric, RunTag

        active = self._active[run_id]
        now = int(time.time() * 1000)
        numbers = scalars(metrics)
        world_size = numbers.pop(_WORLD_SIZE, None)
        batch = [Metric(key, value, now, int(metrics["epoch"])) for key, value in numbers.items()]
        tags = [RunTag(_WORLD_SIZE, str(int(world_size)))] if world_size is not None else []
        active.client.log_batch(active.run_id, metrics=batch, tags=tags)

    @_bounded
    def on_fit_end(self, model: Any, checkpoint: Any, run_id: str) -> None:
        """Logs the model (when ``log_model``) and marks the run FINISHED."""
        active = self._active.pop(run_id)
        try:
            if self.log_model:
                self._log_model(active, model, checkpoint.progress.epoch)
        finally:
            active.client.set_terminated(active.run_id, "FINISHED")

    @_bounded
    def on_fit_failed(self, error: BaseException, run_id: str) -> None:
        """Marks the run FAILED (KILLED when interrupted); what was logged stays."""
        active = self._active.pop(run_id)
        active.client.set_tag(active.run_id, _ERROR_TAG, f"{type(error).__name__}: {error}"[:5000])
        active.client.set_terminated(active.run_id, "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")

    def _log_model(self, active: _Active, model: Any, epoch: int) -> None:
        import mlflow

        requirements = self.pip_requirements or _requirements()
        if installed("mlflow") < (3, 0):  # no logged models: the model is the run's artifact "model"
            with tempfile.TemporaryDirectory(prefix="spark_torch_est-model-") as folder:
                mlflow.pytorch.save_model(model.torch_model(), f"{folder}/model", input_example=input_example(model),
                                          pip_requirements=requirements)
                active.client.log_artifacts(active.run_id, f"{folder}/model", "model")
            return
        # Created here so that the model lands in the run's experiment, whatever the
        # process-wide MLflow state says.
        logged = active.client.create_logged_model(active.experiment_id, name="model", source_run_id=active.run_id)
        with _process_tracking_uri(self.tracking_uri):
            mlflow.pytorch.log_model(model.torch_model(), name="model", input_example=input_example(model),
                                     run_id=active.run_id, model_id=logged.model_id, step=epoch,
                                     pip_requirements=requirements)

    def _ambient(self) -> bool:
        """Whether this logger logs where MLflow's process-wide tracking URI points."""
        import mlflow

        return self.tracking_uri is None or self.tracking_uri == mlflow.get_tracking_uri()

    def _parent_run(self) -> Any:
        """The active MLflow run to nest under: this thread's, else the newest one started in
        another thread of the driver (MLflow's own rule for that case; events run in the
        logger's own thread, so this is where ``fit``'s caller's run is found), else None."""
        import mlflow
        from mlflow.tracking import fluent

        if not self._ambient():
            return None
        run = mlflow.active_run()
        if run is None and hasattr(fluent, "_get_latest_active_run"):
            run = fluent._get_latest_active_run()
        return run

    def _experiment_id(self, client: Any, parent: Any) -> str:
        name = self.experiment_name
        if name is None and parent is not None:
            return parent.info.experiment_id
        if name is None and self._ambient():
            from mlflow.tracking import fluent

            return fluent._get_experiment_id() or "0"  # set_experiment, environment, Databricks notebook
        name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name is None:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        return client.create_experiment(name, artifact_location=self.artifact_location)


@contextmanager
def _process_tracking_uri(uri: str | None) -> Iterator[None]:
    """``mlflow.pytorch.log_model`` has no tracking URI argument: it logs where MLflow's
    process-wide URI points. Points it at ``uri`` for the call and back afterwards."""
    import mlflow

    if uri is None or uri == mlflow.get_tracking_uri():
        yield
        return
    with _URI_LOCK:
        # set_tracking_uri mirrors the URI into MLFLOW_TRACKING_URI, so this is the
        # process-wide setting before the call (None: neither was set).
        before = os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            # mlflow annotates uri as str | Path, but takes None too: it then unsets the setting
            mlflow.set_tracking_uri(before)  # type: ignore[arg-type]


def input_example(model: TorchModel) -> np.ndarray | None:
    """An input batch for ``model``, as tracking tools want it to infer a signature (and,
    for MLflow's default pt2 format, to trace the model): zeros shaped like the features
    the model was trained on. Two rows, since a traced one-row example fixes the batch
    size at 1. None for a model of several typed inputs (``inputCols``), which MLflow's
    single-tensor PyTorch flavor cannot describe, or of arrays padded per batch."""
    checkpoint = model.checkpoint
    if checkpoint.input_schema.layout != FEATURES_LAYOUT or checkpoint.input_row_shapes[0] is None:
        return None
    return np.zeros((2, *checkpoint.input_row_shapes[0]), dtype=np.float32)


def _requirements() -> list[str]:
    """torch and cloudpickle (what ``mlflow.pytorch`` loads a model with) pinned to this
    process's versions; a local version label (``2.13.0+cpu``) is dropped, as MLflow does,
    so that pip can install them."""
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in ("torch", "cloudpickle")]


def _text(value: Any) -> str:
    text = str(value)
    return text if len(text) <= _MAX_PARAM else text[:_MAX_PARAM - 3] + "..."
