"""[driver] TorchEstimator: validate -> launch -> TorchModel, and the run it carries between fits."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import posixpath
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

import cloudpickle
from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.base import _FitMultipleIterator
from pyspark.sql import DataFrame

from spark_torch_est import moved
from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.checkpoints.storage import CheckpointDir
from spark_torch_est.cluster.launcher import Launcher
from spark_torch_est.cluster.messages import RankMessage
from spark_torch_est.core.duration import Duration
from spark_torch_est.core.progress import Progress
from spark_torch_est.core.running import fit_logger, running_fit
from spark_torch_est.core.spec import TaskSpec
from spark_torch_est.errors import (
    IncompatibleCheckpointError,
    InvalidInputError,
    SparkTorchError,
    TrainingCompleteError,
    TrainingFailedError,
)
from spark_torch_est.ingest.kept_registry import KeptIngest
from spark_torch_est.loggers import Logger
from spark_torch_est.loggers.base import normalize_loggers
from spark_torch_est.loggers.dispatch import LoggerDispatch
from spark_torch_est.loggers.view import DriverView
from spark_torch_est.model import TorchModel
from spark_torch_est.params.base import EstimatorParams, carry_params, param_map_name
from spark_torch_est.persistence import TorchPersistence, loaded_checkpoint, read_required, saved_checkpoint
from spark_torch_est.planning import (
    checked_config,
    checked_trainer_args,
    make_creators,
    plan_fit,
    plan_frame,
    release_claim,
    resolve_checkpoint,
)
from spark_torch_est.together import Together
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.hooks import Hook, HookSet, normalize_hooks, storable_state

if TYPE_CHECKING:
    from pyspark.ml._typing import ParamMap
    from pyspark.ml.util import MLWriter

__all__ = ["TorchEstimator"]

logger = fit_logger()

_CREATOR_ARGS = ("model", "optimizer", "loss", "scheduler", "metrics", "hooks", "callbacks")
#: Guards every estimator's ``_fitting`` flag while a fit checks and sets it.
_FITTING = threading.Lock()
_T = TypeVar("_T")


class TorchEstimator(Estimator[TorchModel], EstimatorParams, TorchPersistence):
    """Trains a PyTorch model on a DataFrame with DDP in Spark barrier tasks.

    Each fit continues the estimator's run: ``fit(df)`` trains to ``maxEpochs``,
    ``fit(df, duration="2ep")`` two more epochs (never past ``maxEpochs``). ``copy()`` and
    ``reset()`` start a new run. One fit of a run at a time: a ``fit`` while another
    thread's fit of the same estimator runs is refused; copies fit in parallel.

    Args:
        model: An ``nn.Module`` or ``callable(config) -> nn.Module``; or a LightningModule (or
            its creator), trained by Lightning's own loop without optimizer= or loss= (see
            docs/lightning.md).
        optimizer: ``callable(model, config) -> torch.optim.Optimizer``.
        loss: An ``nn.Module`` (or its class) or ``callable(outputs, labels) -> scalar``.
        scheduler: ``callable(optimizer, config) -> LR scheduler`` stepped once per epoch, or None.
        metrics: ``{name: callable(outputs, labels) | torchmetrics.Metric}`` computed on the
            validation rows each epoch, or None.
        hooks: A list of :class:`Hook` or a ``{name: Hook}`` dict, or None.
        callbacks: With a LightningModule: a list of Lightning callbacks (``EarlyStopping``,
            ``LearningRateMonitor``, ...), or None.
        loggers: A list of :class:`~spark_torch_est.loggers.Logger` run on the driver
            (experiment tracking, see docs/tracking.md), or None.
        config: A plain dict of JSON values handed to every creator (default ``{}``); a Param,
            so ``ParamGridBuilder`` and the tuners can vary it.
        featuresCol: Vector, ``array<numeric>`` or numeric column (default ``"features"``).
        featureCols: Numeric columns used instead of featuresCol (default None).
        inputCols: Columns given to the model as separate typed inputs, ``model(*inputs)``,
            instead of featuresCol/featureCols (default None): integers as int64, floats as
            float32, booleans, binary as uint8, arrays and Vectors with their shapes.
        inputShapes: ``{column: [sizes]}`` reshaping each row of an inputCols column
            (default None).
        paddingValue: What arrays shorter than their batch's longest row are padded with
            (default 0).
        weightCol: Numeric column of per-row sample weights (default None): the training
            loss, ``val_loss`` and ``evaluate()`` become weighted means.
        labelCol: Label column (default ``"label"``); integers are class indices.
        predictionCol: Output column of the model (default ``"prediction"``); for
            classifiers (integer labels, several outputs) the class index.
        rawPredictionCol: For classifiers: Vector column of the outputs, i.e. logits
            (default ``"rawPrediction"``; ``""`` omits it).
        probabilityCol: For classifiers: Vector column of their softmax (default
            ``"probability"``; ``""`` omits it).
        validationIndicatorCol: Boolean column, True for validation rows (default None).
        batchSize: Rows per worker per step (default 64).
        maxEpochs: The run never trains past this (default 10).
        numWorkers: Barrier tasks, i.e. DDP ranks (default 2).
        minWorkers: Fewest ranks a launch may train with when fewer than numWorkers task
            slots are free after slotWaitTimeout, keeping the global batch
            ``batchSize * numWorkers`` (default None: numWorkers, no elasticity; see
            docs/reliability.md).
        seed: Seed of initialization, shuffles and RNG streams (default 0).
        checkpointDir: fsspec URL for periodic checkpoints (default None).
        checkpointInterval: Duration between periodic checkpoints (default ``"1ep"``).
        maxRetries: Relaunches after failures a relaunch can fix (default 1).
        useGpu: True, False or None to use GPUs when tasks have them (default None).
        timeout: Seconds before a stuck rendezvous or collective fails the fit (default 600).
        slotWaitTimeout: Seconds to wait for numWorkers free task slots (default 60).
        showProgress: A progress bar (terminal, notebook), else progress and epoch lines on stderr
            or through logging where it is set up (default True).
        memoryBudgetMB: MB of a partition's feature rows a rank keeps in RAM; the rest
            goes to local files read per batch (default 4096; 0 never spills).
        keepIngestedMB: MB of rows each executor keeps on its local disk between fits, so
            that a later fit on the same unchanged DataFrame skips Spark's scan and shuffle
            (default 8192; 0 keeps nothing; see docs/ingest.md).
        inferenceBatchSize: Rows per forward pass in ``transform`` (default 4096).
        allowNonFinite: Train on when the loss is NaN or infinite, or an epoch's weightCol
            weights sum to 0 (default False: the fit fails at that step with
            ``TrainingFailedError``, or at that epoch's end with ``InputDataError``, and the
            run keeps its last state).
        directRead: Let the tasks read a plain Parquet table on a local or mounted
            filesystem themselves, with pyarrow (default True; see docs/ingest.md); the
            model keeps it for ``transform`` and ``evaluate``.
        precision: ``"32"``, ``"bf16-mixed"`` (bfloat16 autocast) or ``"16-mixed"``
            (float16 autocast and a gradient scaler) for the forward pass and loss (default
            ``"32"``); weights stay float32 (see docs/gpu.md).
        compileModel: Compile each rank's model with ``torch.compile`` (default False).
        strategy: ``"ddp"`` or ``"fsdp"`` (default ``"ddp"``). With ``"ddp"`` every rank
            holds the whole model; with ``"fsdp"`` (FSDP2) each rank holds its shard of the
            parameters and optimizer state, and checkpoints are sharded under checkpointDir,
            which it needs (see docs/large-models.md).
        shardModules: With ``"fsdp"``: class names of the submodules sharded on their own
            before the root (default None: every direct child holding parameters).
        trainerArgs: With a LightningModule: more arguments of Lightning's ``Trainer`` as JSON
            values (default ``{}``), not those the estimator sets (devices, num_nodes,
            strategy, max_epochs, ...).
    """

    _input_kwargs: dict[str, Any]  # the constructor's arguments, as @keyword_only records them

    @keyword_only
    def __init__(self, *, model: Any = None, optimizer: Any = None, loss: Any = None,
                 scheduler: Any = None, metrics: Mapping[str, Any] | None = None,
                 hooks: Iterable[Hook] | Mapping[str, Hook] | None = None, callbacks: list[Any] | None = None,
                 loggers: Iterable[Logger] | None = None,
                 config: Mapping[str, Any] | None = None, featuresCol: str | None = "features",
                 featureCols: list[str] | None = None, inputCols: list[str] | None = None,
                 inputShapes: dict[str, list[int]] | None = None, paddingValue: float = 0.0,
                 labelCol: str = "label", weightCol: str | None = None,
                 predictionCol: str = "prediction", rawPredictionCol: str = "rawPrediction",
                 probabilityCol: str = "probability",
                 validationIndicatorCol: str | None = None, batchSize: int = 64, maxEpochs: int = 10,
                 numWorkers: int = 2, minWorkers: int | None = None, seed: int = 0, checkpointDir: str | None = None,
                 checkpointInterval: str = "1ep", maxRetries: int = 1, useGpu: bool | None = None,
                 timeout: float = 600.0, slotWaitTimeout: float = 60.0, showProgress: bool = True,
                 memoryBudgetMB: float = 4096.0, keepIngestedMB: float = 8192.0, inferenceBatchSize: int = 4096,
                 allowNonFinite: bool = False, directRead: bool = True, precision: str = "32",
                 compileModel: bool = False, strategy: str = "ddp", shardModules: list[str] | None = None,
                 trainerArgs: Mapping[str, Any] | None = None) -> None:
        super().__init__()  # the Params' defaults: see params/table.py
        kwargs = dict(self._input_kwargs)
        if "config" in kwargs:
            kwargs["config"] = checked_config(kwargs["config"])
        if "trainerArgs" in kwargs:
            kwargs["trainerArgs"] = checked_trainer_args(kwargs["trainerArgs"])
        creator_args = {name: kwargs.pop(name) for name in _CREATOR_ARGS if name in kwargs}
        self._creators = make_creators(**creator_args)
        self._initial_hook_states = _hook_states(self._creators.hooks)
        self._fresh_hooks: set[str] = set()  # hooks added since the last fit: they keep their own state
        self._loggers = normalize_loggers(kwargs.pop("loggers", None))  # driver only: not in the creators
        self._checkpoint: Checkpoint | None = None
        self._fitting = False  # a fit of this run is in progress (see _one_fit_at_a_time)
        self._folds = 0  # fitMultiple calls (a tuner's splits) since the last refit
        self._fold: str | None = None  # in a copy made by fitMultiple: its split ("split 2")
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

    def setHooks(self, hooks: Iterable[Hook] | Mapping[str, Hook] | None) -> TorchEstimator:
        """Replaces the hooks between fits of the run. A hook object already there keeps
        its state; a new one starts from its own (``before_run`` is called for every hook
        at every fit); a hook left out is dropped with its state."""
        old, new = self._creators.hooks, normalize_hooks(hooks)
        HookSet(new)
        added = {name for name, hook in new.items() if old.get(name) is not hook}
        self._initial_hook_states = {**{n: s for n, s in self._initial_hook_states.items() if n in new},
                                     **_hook_states({n: new[n] for n in added})}
        self._fresh_hooks = (self._fresh_hooks & set(new)) | added
        self._creators = dataclasses.replace(self._creators, hooks=new)
        return self

    def setConfig(self, config: Mapping[str, Any]) -> TorchEstimator:
        """Replaces the config between fits: the next fit builds the model (which must
        still fit the run's checkpoint), optimizer, scheduler and loss from it, and takes
        the optimizer's hyper-parameters (``lr``, ``weight_decay``, ...) from the new
        optimizer while keeping its state (moments, step counts)."""
        return self._set(config=checked_config(config))

    @property
    def _run_creators(self) -> Creators:
        """The creators with the config Param: what the driver builds from and the tasks get."""
        return dataclasses.replace(self._creators, config=self.getConfig())

    def setLoss(self, loss: Any) -> TorchEstimator:
        """Replaces the loss between fits (an ``nn.Module``, its class, or a callable)."""
        make_creators(loss=loss)
        self._creators = dataclasses.replace(self._creators, loss=loss)
        return self

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
        self._fresh_hooks = set()
        for name, hook in self._creators.hooks.items():
            hook.load_state_dict(copy.deepcopy(self._initial_hook_states[name]))
        return self

    def copy(self, extra: dict | None = None) -> TorchEstimator:
        """A copy with the same creators and Params and a new run (hooks and loggers are copied too)."""
        that = super().copy(extra)
        that._creators = copy.copy(self._creators)
        that._creators.hooks = _deep_copy("hooks", self._creators.hooks)
        that._loggers = _deep_copy("loggers", self._loggers)
        that._checkpoint = None
        that._fitting = False
        that.reset()
        return that

    # ------------------------------------------------------------------------ fit

    @overload
    def fit(self, dataset: DataFrame, params: ParamMap | None = None, *, duration: str | Duration | None = None,
            resume_from: TorchModel | Checkpoint | str | None = None) -> TorchModel: ...

    @overload
    def fit(self, dataset: DataFrame, params: list[ParamMap] | tuple[ParamMap, ...], *,
            duration: str | Duration | None = None,
            resume_from: TorchModel | Checkpoint | str | None = None) -> list[TorchModel]: ...

    def fit(self, dataset: DataFrame, params: ParamMap | list[ParamMap] | tuple[ParamMap, ...] | None = None, *,
            duration: str | Duration | None = None,
            resume_from: TorchModel | Checkpoint | str | None = None) -> TorchModel | list[TorchModel]:
        """Trains and returns a :class:`TorchModel`; continues this estimator's run.

        Param maps work as in ``pyspark.ml.Estimator.fit``: a non-empty dict trains a copy
        with those Params (a new run; this estimator's run is left alone), a list or tuple
        of param maps returns one model per map (``[]`` for an empty one), and ``duration``
        and ``resume_from`` apply to each of those fits.

        Args:
            dataset: The training DataFrame.
            params: An optional param map, or a list/tuple of param maps.
            duration: ``"3ep"``, ``"500ba"`` or ``"100000sp"`` more training, capped at
                ``maxEpochs``; None trains to ``maxEpochs``.
            resume_from: A TorchModel, Checkpoint, checkpoint path or checkpointDir to
                continue from instead of this estimator's own run.

        Returns:
            A :class:`TorchModel`, or a list of them for a list/tuple of param maps.

        Raises:
            TypeError: ``params`` is neither a dict nor a list/tuple (as in pyspark).
            InvalidInputError: Bad DataFrame, Params, creators or ``resume_from`` (before any Spark job).
            TrainingCompleteError: The run already reached ``maxEpochs``.
            TrainingFailedError: A rank failed; the estimator's run is unchanged.
        """
        try:
            return self._fit_maps(dataset, params, duration, resume_from)
        except (InvalidInputError, TrainingCompleteError, IncompatibleCheckpointError) as error:
            # The user's mistake, said in the message: the traceback starts here, at the user's
            # call, not in the package's planning (a thread pool's frames among them); a cause
            # (the user's creator that raised) stays.
            raise error.with_traceback(None) from error.__cause__

    def _fit_maps(self, dataset: DataFrame, params: ParamMap | list[ParamMap] | tuple[ParamMap, ...] | None,
                  duration: str | Duration | None, resume_from: Any) -> TorchModel | list[TorchModel]:
        if params is None:
            params = {}
        if isinstance(params, (list, tuple)):
            return [self.fit(dataset, param_map, duration=duration, resume_from=resume_from)
                    for param_map in params]
        if not isinstance(params, dict):
            raise TypeError(f"Params must be either a param map or a list/tuple of param maps, but got {type(params)}.")
        if not params:
            return self._fit_run(dataset, duration, resume_from)
        if duration is not None:
            warnings.warn(
                "fit(df, params, duration=...) trains a copy with the param map: a new run each call, which never "
                "continues the last one; to train a configuration in steps, make it once with est.copy(params) "
                "and call fit(df, duration=...) on that copy", UserWarning, stacklevel=3)
        return self.copy(params)._fit_run(dataset, duration, resume_from, self._search_name(params))

    def fitMultiple(self, dataset: DataFrame, paramMaps: Sequence[ParamMap]) -> Iterator[tuple[int, TorchModel]]:
        """As in pyspark (``CrossValidator`` calls it once per fold, ``TrainValidationSplit``
        once), and each fit is named for the loggers after its param map and the split, the
        calls counted (``"batchSize=32 (split 2)"``); the tuner's refit with the best map that
        follows is ``"... (refit)"``. Maps that change only what a rank trains are trained
        together, in one barrier job, when the first model is asked for; each model is the
        one its own fit gives (see :mod:`spark_torch_est.together`)."""
        self._folds += 1
        estimator = self.copy()
        estimator._fold = f"split {self._folds}"
        return _FitMultipleIterator(Together(estimator, dataset, list(paramMaps)).model, len(paramMaps))

    def _search_name(self, params: ParamMap) -> str:
        """The name of a fit with a param map: the map, and its fold in a tuner's search
        (set by :meth:`fitMultiple`) or ``refit`` for the fit that follows the search."""
        text = param_map_name(params)
        where = self._fold
        if where is None and self._folds:
            where, self._folds = "refit", 0
        return f"{text} ({where})" if where else text

    def _fit(self, dataset: DataFrame) -> TorchModel:
        return self._fit_run(dataset, None, None)

    @contextlib.contextmanager
    def _one_fit_at_a_time(self) -> Iterator[None]:
        """Holds this run for one fit; a fit from another thread meanwhile is refused.

        Raises:
            InvalidInputError: The estimator is already fitting.
        """
        with _FITTING:
            if self._fitting:
                raise InvalidInputError(
                    "this TorchEstimator is already fitting (a fit() in another thread has not returned): two fits "
                    "of one run at once would lose one fit's training. Wait for that fit to return, or fit "
                    "est.copy() instead, an independent run with the same Params, which may fit in parallel")
            self._fitting = True
        try:
            yield
        finally:
            self._fitting = False

    def _fit_run(self, dataset: DataFrame, duration: str | Duration | None, resume_from: Any,
                 name: str | None = None) -> TorchModel:
        with self._one_fit_at_a_time():
            return self._fit_alone(dataset, duration, resume_from, name)

    def _fit_alone(self, dataset: DataFrame, duration: str | Duration | None, resume_from: Any,
                   name: str | None) -> TorchModel:
        view = DriverView(self.getShowProgress(), None, None, self.getNumWorkers() * self.getBatchSize(), name or "")
        try:
            return self._fit_shown(dataset, duration, resume_from, name, view)
        finally:
            view.close()

    def _fit_shown(self, dataset: DataFrame, duration: str | Duration | None, resume_from: Any,
                   name: str | None, view: DriverView) -> TorchModel:
        view.phase("checking the DataFrame, the Params and the model")
        start = resolve_checkpoint(resume_from) if resume_from is not None else self._checkpoint
        try:
            return self._fit_planned(dataset, duration, start, name, view)
        except BaseException:
            release_claim(start, self._checkpoint, self.getCheckpointDir())
            raise

    def _fit_planned(self, dataset: DataFrame, duration: str | Duration | None, start: Checkpoint | None,
                     name: str | None, view: DriverView) -> TorchModel:
        plan = plan_fit(self, self._run_creators, dataset, duration, start, self._fresh_hooks, own=self._checkpoint)
        progress = plan.progress
        rows = KeptIngest(dataset.sparkSession, plan.frame, plan.source, self.getNumWorkers(), self.getKeepIngestedMB(),
                          plan.staging)
        loggers = LoggerDispatch(self._loggers, plan.spec.run_id, progress)
        spec = _with_stop_wait(plan.spec, loggers.stop_wait_s)
        loggers.start({p.name: v for p, v in self.extractParamMap().items() if p.name != "config"}, self.getConfig(),
                      progress, name)

        def on_message(message: RankMessage) -> None:
            view.handle(message)
            loggers.handle(message)

        workers = self.getNumWorkers()
        launching = f"launching {workers} rank{'s' if workers > 1 else ''} (a Spark barrier job): they start, read " \
                    "their rows, lay them out and meet before the first step"
        launcher = Launcher(dataset.sparkSession, rows, self.getMaxRetries(), self.getSlotWaitTimeout(),
                            on_message, min_workers=self.getMinWorkers(),
                            replan=lambda ranks, partitions: plan_frame(self, dataset, plan.schema, ranks, partitions),
                            on_ask=lambda epoch: loggers.stop_asked(epoch, spec.stop_wait_s or 0.0),
                            on_phase=lambda text: view.phase(text or launching))
        label = name or f"run {spec.run_id[:8]}"
        if start is None:
            _say_if_dir_holds_a_run(self.getCheckpointDir(), self.getMaxEpochs())
        view.name = label
        view.planned(progress, plan.target)
        try:
            with running_fit(label):
                view.phase(launching)
                checkpoint = _train(launcher, spec, progress)
            view.finish(checkpoint.progress, checkpoint.history)
        except BaseException as error:
            loggers.fail(error)
            raise
        finally:
            rows.close()
        model = self._fitted(checkpoint)
        loggers.finish(model, checkpoint)
        if loggers.stop_error is not None:  # a logger stopped the fit to have it raise this (optuna.TrialPruned)
            raise loggers.stop_error
        return model

    def _fitted(self, checkpoint: Checkpoint) -> TorchModel:
        """Takes a fit's result into the run (its checkpoint, the hooks' states); its model."""
        for name, hook in self._creators.hooks.items():
            if name in checkpoint.hook_states:
                hook.load_state_dict(checkpoint.hook_states[name])
        self._checkpoint = checkpoint
        self._fresh_hooks = set()
        logger.info("fit done: %s", checkpoint.progress)
        return self._model(checkpoint)

    def _model(self, checkpoint: Checkpoint) -> TorchModel:
        model = TorchModel(creators=self._run_creators, checkpoint=checkpoint)
        carry_params(self, model)
        return model

    # ---------------------------------------------------------------- persistence

    def write(self) -> MLWriter:
        """Saves the estimator (see :class:`TorchPersistence`), once its loggers are known to
        pickle: one that refuses (``OptunaPruning``) fails the save before anything is written."""
        cloudpickle.dumps(self._loggers)
        return super().write()

    def _persisted_files(self, folder: str) -> dict[str, bytes]:
        """Creators and hooks cloudpickled, the loggers apart from them, and the checkpoint
        with a copy of its sharded state in ``folder`` (see persistence.py); the config is
        a Param, saved with the others as JSON."""
        files = {"creators.pkl": cloudpickle.dumps((self._creators, self._initial_hook_states, self._fresh_hooks))}
        if self._loggers:
            files["loggers.pkl"] = cloudpickle.dumps(self._loggers)
        if self._checkpoint is not None:
            files["checkpoint.pt"] = saved_checkpoint(self._checkpoint, folder)
        return files

    @classmethod
    def _from_files(cls, read: Callable[[str], bytes | None], folder: str) -> TorchEstimator:
        instance = cls()
        creators, instance._initial_hook_states, instance._fresh_hooks = moved.loads(
            read_required(read, "creators.pkl", folder), f"{folder}/creators.pkl")
        instance._creators = creators
        if creators.config:  # saved before config became a Param; a saved Param wins
            instance._set(config=checked_config(creators.config))
        loggers = read("loggers.pkl")
        instance._loggers = moved.loads(loggers, f"{folder}/loggers.pkl") if loggers is not None else []
        blob = read("checkpoint.pt")
        instance._checkpoint = loaded_checkpoint(blob, folder) if blob is not None else None
        return instance


def _train(launcher: Launcher, spec: TaskSpec, start: Progress) -> Checkpoint:
    """Runs the fit's jobs; only SparkTorchError subclasses (and KeyboardInterrupt) escape."""
    try:
        return Checkpoint.from_bytes(launcher.run(spec, start))
    except (SparkTorchError, KeyboardInterrupt):
        raise
    except Exception as error:  # the package promises its own errors only
        raise TrainingFailedError(f"the fit failed unexpectedly: {type(error).__name__}: {error}") from error


def _say_if_dir_holds_a_run(checkpoint_dir: str | None, max_epochs: int) -> None:
    """Warns before a new run trains when ``checkpointDir`` already holds a run (a new driver
    with the same estimator): which run, how far it came, and how to continue it instead."""
    if checkpoint_dir is None:
        return
    try:
        newest = CheckpointDir(checkpoint_dir).latest()
    except (OSError, ValueError) as error:  # a notice only: the fit's own writes will tell
        logger.debug("could not list checkpointDir=%s: %s", checkpoint_dir, error)
        return
    if newest is not None:
        logger.warning(
            "checkpointDir=%r already holds a run: its newest checkpoint %s is at epoch %d of maxEpochs=%d (global "
            "step %d). This fit starts a new run from epoch 0 beside it; to continue that run instead, call "
            "fit(df, resume_from=%r)", checkpoint_dir, posixpath.basename(newest.url), newest.epoch, max_epochs,
            newest.global_step, checkpoint_dir)


def _with_stop_wait(spec: TaskSpec, wait: float | None) -> TaskSpec:
    """``spec`` with the time the driver may take to answer rank 0's stop question at an
    epoch end (None: no logger may stop the fit), at most half the collectives' ``timeout``
    (the other ranks wait for the answer in the epoch end's flag agreement)."""
    return dataclasses.replace(spec, stop_wait_s=None if wait is None else min(wait, spec.timeout_s / 2))


def _deep_copy(what: str, original: _T) -> _T:
    """A deep copy of the estimator's hooks or loggers (``what``), for ``copy()``.

    Raises:
        InvalidInputError: One of them cannot be copied.
    """
    try:
        return copy.deepcopy(original)
    except (TypeError, AttributeError, copy.Error) as error:  # a lock, a socket, a client in a hook
        raise InvalidInputError(
            f"copy() copies the {what}, and one of them cannot be copied ({type(error).__name__}: {error}); "
            f"give it __deepcopy__ (or __getstate__/__setstate__), or create what it holds lazily") from None


def _hook_states(hooks: Mapping[str, Hook]) -> dict[str, dict]:
    """Each hook's state now, as a checkpoint would store it (a copy: ``reset`` restores it)."""
    return {name: copy.deepcopy(storable_state(name, hook.state_dict())) for name, hook in hooks.items()}
