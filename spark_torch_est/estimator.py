"""[driver] TorchEstimator: validate -> launch -> TorchModel, and the run it carries between fits."""

from __future__ import annotations

import copy
import functools
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

import cloudpickle
import torch
from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.sql import DataFrame
from pyspark.sql.utils import is_remote

from spark_torch_est.checkpoint import Checkpoint, check_compatible
from spark_torch_est.creators import CreatorError, Creators
from spark_torch_est.duration import Duration
from spark_torch_est.errors import InvalidInputError, TrainingCompleteError
from spark_torch_est.frames import training_frame
from spark_torch_est.hooks import Hook, HookSet, normalize_hooks
from spark_torch_est.launcher import Launcher
from spark_torch_est.logger_dispatch import LoggerDispatch
from spark_torch_est.loggers import Logger, normalize_loggers
from spark_torch_est.model import TorchModel
from spark_torch_est.params import ESTIMATOR_DEFAULTS, MODEL_DEFAULTS, EstimatorParams
from spark_torch_est.persistence import TorchPersistence
from spark_torch_est.progress import Progress
from spark_torch_est.spec import Target, TaskSpec
from spark_torch_est.view import DriverView

__all__ = ["TorchEstimator"]

logger = logging.getLogger(__name__)

_CREATOR_ARGS = ("model", "optimizer", "loss", "scheduler", "metrics", "hooks", "config")


class TorchEstimator(Estimator, EstimatorParams, TorchPersistence):
    """Trains a PyTorch model on a DataFrame with DDP in Spark barrier tasks.

    Each fit continues the estimator's run: ``fit(df)`` trains to ``maxEpochs``,
    ``fit(df, duration="2ep")`` two more epochs (never past ``maxEpochs``). ``copy()`` and
    ``reset()`` start a new run.

    Args:
        model: An ``nn.Module`` or ``callable(config) -> nn.Module``.
        optimizer: ``callable(model, config) -> torch.optim.Optimizer``.
        loss: An ``nn.Module`` (or its class) or ``callable(outputs, labels) -> scalar``.
        scheduler: ``callable(optimizer, config) -> LR scheduler`` stepped once per epoch, or None.
        metrics: ``{name: callable(outputs, labels) | torchmetrics.Metric}`` computed on the
            validation rows each epoch, or None.
        hooks: A list of :class:`Hook` or a ``{name: Hook}`` dict, or None.
        loggers: A list of :class:`~spark_torch_est.loggers.Logger` run on the driver
            (experiment tracking, see docs/tracking.md), or None.
        config: A plain dict handed to every creator (default ``{}``).
        featuresCol: Vector, ``array<numeric>`` or numeric column (default ``"features"``).
        featureCols: Numeric columns used instead of featuresCol (default None).
        labelCol: Label column (default ``"label"``); integers are class indices.
        predictionCol: Output column of the model (default ``"prediction"``).
        probabilityCol: Class probabilities column for classifiers (default None: omitted).
        validationIndicatorCol: Boolean column, True for validation rows (default None).
        batchSize: Rows per worker per step (default 64).
        maxEpochs: The run never trains past this (default 10).
        numWorkers: Barrier tasks, i.e. DDP ranks (default 2).
        seed: Seed of initialization, shuffles and RNG streams (default 0).
        checkpointDir: fsspec URL for periodic checkpoints (default None).
        checkpointInterval: Duration between periodic checkpoints (default ``"1ep"``).
        maxRetries: Relaunches after failures a relaunch can fix (default 1).
        useGpu: True, False or None to use GPUs when tasks have them (default None).
        timeout: Seconds before a stuck rendezvous or collective fails the fit (default 600).
        slotWaitTimeout: Seconds to wait for numWorkers free task slots (default 60).
        showProgress: Progress bar or log lines on the driver (default True).
        memoryBudgetMB: MB of a partition's feature rows a rank keeps in RAM; the rest
            goes to local files read per batch (default 4096; 0 never spills).
        inferenceBatchSize: Rows per forward pass in ``transform`` (default 4096).
    """

    @keyword_only
    def __init__(self, *, model: Any = None, optimizer: Any = None, loss: Any = None,
                 scheduler: Any = None, metrics: Mapping[str, Any] | None = None,
                 hooks: Iterable[Hook] | Mapping[str, Hook] | None = None, loggers: Iterable[Logger] | None = None,
                 config: Mapping[str, Any] | None = None, featuresCol: str | None = "features",
                 featureCols: list[str] | None = None, labelCol: str = "label",
                 predictionCol: str = "prediction", probabilityCol: str | None = None,
                 validationIndicatorCol: str | None = None, batchSize: int = 64, maxEpochs: int = 10,
                 numWorkers: int = 2, seed: int = 0, checkpointDir: str | None = None,
                 checkpointInterval: str = "1ep", maxRetries: int = 1, useGpu: bool | None = None,
                 timeout: float = 600.0, slotWaitTimeout: float = 60.0, showProgress: bool = True,
                 memoryBudgetMB: float = 4096.0, inferenceBatchSize: int = 4096) -> None:
        super().__init__()
        self._setDefault(**MODEL_DEFAULTS, **ESTIMATOR_DEFAULTS)
        kwargs = dict(self._input_kwargs)
        creator_args = {name: kwargs.pop(name) for name in _CREATOR_ARGS if name in kwargs}
        self._creators = _make_creators(**creator_args)
        self._initial_hook_states = _hook_states(self._creators.hooks)
        self._loggers = normalize_loggers(kwargs.pop("loggers", None))  # driver only: not in the creators
        self._checkpoint: Checkpoint | None = None
        self._set(**kwargs)

    # ----------------------------------------------------------------- run state

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The latest checkpoint of this run, or None before the first fit."""
        return self._checkpoint

    @property
    def progress(self) -> Progress:
        """Where the run stands."""
        return self._checkpoint.progress if self._checkpoint is not None else Progress()

    @property
    def history(self) -> list[dict]:
        """One metrics dict per completed epoch of this run."""
        return self._checkpoint.history if self._checkpoint is not None else []

    @property
    def hooks(self) -> dict[str, Hook]:
        """The driver's hook objects (their state follows each fit)."""
        return dict(self._creators.hooks)

    @property
    def loggers(self) -> list[Logger]:
        """The loggers that follow this estimator's fits on the driver."""
        return list(self._loggers)

    def setLoggers(self, loggers: Iterable[Logger] | None) -> TorchEstimator:
        """Replaces the loggers; the next fit uses the new ones."""
        self._loggers = normalize_loggers(loggers)
        return self

    def reset(self) -> TorchEstimator:
        """Starts a new run: fresh weights, optimizer, scheduler, counters and hook state."""
        self._checkpoint = None
        for name, hook in self._creators.hooks.items():
            hook.load_state_dict(copy.deepcopy(self._initial_hook_states[name]))
        return self

    def copy(self, extra: dict | None = None) -> TorchEstimator:
        """A copy with the same creators and Params and a new run (hooks and loggers are copied too)."""
        that = super().copy(extra)
        that._creators = copy.copy(self._creators)
        that._creators.hooks = copy.deepcopy(self._creators.hooks)
        that._loggers = copy.deepcopy(self._loggers)
        that._checkpoint = None
        that.reset()
        return that

    # ------------------------------------------------------------------------ fit

    def fit(self, dataset: DataFrame, params: Any = None, *, duration: str | Duration | None = None,
            resume_from: Any = None) -> Any:
        """Trains and returns a :class:`TorchModel`; continues this estimator's run.

        Args:
            dataset: The training DataFrame.
            params: An optional param map (trains a copy, i.e. a new run, as in pyspark.ml).
            duration: ``"3ep"`` or ``"500ba"`` more training, capped at ``maxEpochs``;
                None trains to ``maxEpochs``.
            resume_from: A TorchModel, Checkpoint or checkpoint path to continue from
                instead of this estimator's own run.

        Raises:
            InvalidInputError: Bad DataFrame, Params or creators (before any Spark job).
            TrainingCompleteError: The run already reached ``maxEpochs``.
            TrainingFailedError: A rank failed; the estimator's run is unchanged.
        """
        if params:
            if isinstance(params, (list, tuple)):
                return super().fit(dataset, params)
            return self.copy(params).fit(dataset, duration=duration, resume_from=resume_from)
        return self._fit_run(dataset, duration, resume_from)

    def _fit(self, dataset: DataFrame) -> TorchModel:
        return self._fit_run(dataset, None, None)

    def _fit_run(self, dataset: DataFrame, duration: str | Duration | None, resume_from: Any) -> TorchModel:
        start = _resolve_checkpoint(resume_from) if resume_from is not None else self._checkpoint
        self._check_params()
        target = self._target(start.progress if start is not None else Progress(), duration)
        frame = self._checked_frame(dataset, start)
        spec = self._spec(target, start)
        spark = dataset.sparkSession
        progress = start.progress if start is not None else Progress()
        view = DriverView(self.getShowProgress(), progress, target)
        loggers = LoggerDispatch(self._loggers, spec.run_id, progress)
        loggers.start({p.name: v for p, v in self.extractParamMap().items()}, dict(self._creators.config), progress)

        def on_message(message: dict) -> None:
            view.handle(message)
            loggers.handle(message)

        try:
            blob = Launcher(spark, frame, self.getMaxRetries(), self.getSlotWaitTimeout(), on_message).run(spec)
            checkpoint = Checkpoint.from_bytes(blob)
        except BaseException as error:
            loggers.fail(error)
            raise
        finally:
            view.close()
        for name, hook in self._creators.hooks.items():
            if name in checkpoint.hook_states:
                hook.load_state_dict(checkpoint.hook_states[name])
        self._checkpoint = checkpoint
        logger.info("fit done: %s", checkpoint.progress)
        model = self._model(checkpoint)
        loggers.finish(model, checkpoint)
        return model

    def _model(self, checkpoint: Checkpoint) -> TorchModel:
        model = TorchModel(creators=self._creators, checkpoint=checkpoint)
        for name in MODEL_DEFAULTS:
            if self.isSet(name):
                model._set(**{name: self.getOrDefault(name)})
        return model

    # ---------------------------------------------------------------- persistence

    def _persisted_files(self) -> dict[str, bytes]:
        """Creators and hooks cloudpickled, the loggers apart from them, and the checkpoint
        (see persistence.py)."""
        files = {"creators.pkl": cloudpickle.dumps((self._creators, self._initial_hook_states))}
        if self._loggers:
            files["loggers.pkl"] = cloudpickle.dumps(self._loggers)
        if self._checkpoint is not None:
            files["checkpoint.pt"] = self._checkpoint.to_bytes()
        return files

    @classmethod
    def _from_files(cls, read: Callable[[str], bytes | None]) -> TorchEstimator:
        instance = cls()
        instance._creators, instance._initial_hook_states = cloudpickle.loads(read("creators.pkl"))
        loggers = read("loggers.pkl")
        instance._loggers = cloudpickle.loads(loggers) if loggers is not None else []
        blob = read("checkpoint.pt")
        instance._checkpoint = Checkpoint.from_bytes(blob) if blob is not None else None
        return instance

    # ----------------------------------------------------------------- validation

    def _target(self, progress: Progress, duration: str | Duration | None) -> Target:
        max_epochs = self.getMaxEpochs()
        if progress.epoch >= max_epochs:
            raise TrainingCompleteError(
                f"the run is complete: {progress.epoch} of maxEpochs={max_epochs} epochs are done. "
                "Raise maxEpochs (est.setMaxEpochs(n)) to train further, or call est.reset() to start a new run"
            )
        if duration is None:
            return Target(max_epochs=max_epochs, epoch=max_epochs)
        duration = Duration.parse(duration, what="duration")
        if duration.unit == "ep":
            return Target(max_epochs=max_epochs, epoch=min(progress.epoch + duration.value, max_epochs))
        return Target(max_epochs=max_epochs, epoch=max_epochs, global_step=progress.global_step + duration.value)

    def _check_params(self) -> None:
        for name, low in (("batchSize", 1), ("maxEpochs", 1), ("numWorkers", 1), ("maxRetries", 0),
                          ("inferenceBatchSize", 1), ("memoryBudgetMB", 0)):
            value = self.getOrDefault(name)
            if value < low:
                raise InvalidInputError(f"{name} must be at least {low}, got {value}")
        for name in ("timeout", "slotWaitTimeout"):
            if not self.getOrDefault(name) > 0:
                raise InvalidInputError(f"{name} must be a positive number of seconds, got {self.getOrDefault(name)}")
        Duration.parse(self.getCheckpointInterval(), what="checkpointInterval")

    def _checked_frame(self, dataset: DataFrame, start: Checkpoint | None) -> DataFrame:
        """Checks the creators and prepares the training frame side by side: the JVM plans
        the frame (slow in a fresh session) while Python builds the model and optimizer
        (the first optimizer in a process imports ``torch._dynamo``, ~1.5 s). A creator
        error wins over a column error. Under Spark Connect the client plans nothing, so
        both run in turn."""
        plan = functools.partial(
            training_frame, dataset, features_col=self.getFeaturesCol(), feature_cols=self.getFeatureCols(),
            label_col=self.getLabelCol(), validation_col=self.getValidationIndicatorCol(),
            num_workers=self.getNumWorkers(),
        )
        if is_remote():
            self._check_creators(start)
            return plan()
        context = dataset.sparkSession.sparkContext._jsc.sc()
        properties = context.getLocalProperties().clone()  # the caller's job group, pool, ...

        def plan_here() -> DataFrame:
            context.setLocalProperties(properties)  # as pyspark's inheritable_thread_target does
            return plan()

        with ThreadPoolExecutor(1, thread_name_prefix="spark_torch_est-plan") as pool:
            planned = pool.submit(plan_here)
            self._check_creators(start)
            return planned.result()

    def _check_creators(self, start: Checkpoint | None) -> None:
        """Builds every object once on the driver, so bad creators fail before any job."""
        creators = self._creators
        for name in ("model", "optimizer", "loss"):
            if getattr(creators, name) is None:
                raise InvalidInputError(f"TorchEstimator needs {name}=...; it is None")
        HookSet(creators.hooks)
        try:
            model = creators.build_model()
            if start is not None:
                check_compatible(model.state_dict(), start.model_state)
            creators.build_scheduler(creators.build_optimizer(model))
            creators.build_loss()
        except CreatorError as error:
            raise InvalidInputError(f"{error} (check the {error.creator}= argument)") from error

    def _spec(self, target: Target, start: Checkpoint | None) -> TaskSpec:
        try:
            payload = cloudpickle.dumps(self._creators)
        except Exception as error:
            raise InvalidInputError(
                f"the creators, hooks or config cannot be pickled for the executors: {type(error).__name__}: {error}"
            ) from error
        interval = Duration.parse(self.getCheckpointInterval(), what="checkpointInterval")
        run_id = start.meta.get("run_id") if start is not None else None
        return TaskSpec(
            job_id="", run_id=run_id or uuid.uuid4().hex, payload=payload, resume=start.to_bytes() if start is not None else None,
            target=target, world_size=self.getNumWorkers(), batch_size=self.getBatchSize(),
            seed=self.getSeed(), store_host=None, store_port=None, timeout_s=self.getTimeout(),
            use_gpu=self.getUseGpu(), checkpoint_dir=self.getCheckpointDir(),
            checkpoint_every=(interval.value, interval.unit), label_name=self.getLabelCol(),
            memory_budget=int(self.getMemoryBudgetMB() * (1 << 20)) if self.getMemoryBudgetMB() else None,
        )


def _make_creators(*, model: Any = None, optimizer: Any = None, loss: Any = None, scheduler: Any = None,
                   metrics: Mapping[str, Any] | None = None, hooks: Any = None,
                   config: Mapping[str, Any] | None = None) -> Creators:
    if config is not None and not isinstance(config, Mapping):
        raise InvalidInputError(f"config must be a dict, got {type(config).__name__}")
    for name, value in (("optimizer", optimizer), ("scheduler", scheduler)):
        if value is not None and not callable(value):
            raise InvalidInputError(f"{name} must be a callable creator, got {type(value).__name__}")
    if model is not None and not (isinstance(model, torch.nn.Module) or callable(model)):
        raise InvalidInputError(f"model must be an nn.Module or a callable(config), got {type(model).__name__}")
    if loss is not None and not callable(loss):
        raise InvalidInputError(f"loss must be an nn.Module or a callable(outputs, labels), got {type(loss).__name__}")
    return Creators(model=model, optimizer=optimizer, loss=loss, scheduler=scheduler,
                    metrics=dict(metrics or {}), hooks=normalize_hooks(hooks), config=dict(config or {}))


def _hook_states(hooks: Mapping[str, Hook]) -> dict[str, dict]:
    return {name: copy.deepcopy(hook.state_dict()) for name, hook in hooks.items()}


def _resolve_checkpoint(source: Any) -> Checkpoint:
    if isinstance(source, Checkpoint):
        return source
    if isinstance(source, TorchModel):
        return source.checkpoint
    if isinstance(source, str):
        return Checkpoint.load(source)
    raise InvalidInputError(
        f"resume_from must be a TorchModel, a Checkpoint or a checkpoint path, got {type(source).__name__}"
    )

