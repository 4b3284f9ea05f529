"""[driver] A fit planned on the driver before any Spark job: its Params, the changes within
the run and the creators checked; the target, the inputs, the training frame and the task
spec derived from the estimator's Params.

Everything here raises :class:`InvalidInputError` (or ``TrainingCompleteError`` for a run at
``maxEpochs``) before a job starts, naming the Param or argument that fixes the problem.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import uuid
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypedDict

import cloudpickle
import torch
from pyspark.sql import DataFrame
from pyspark.sql.utils import is_remote

from spark_torch_est.checkpoints.checkpoint import Checkpoint, check_compatible
from spark_torch_est.checkpoints.storage import CheckpointDir, probe_writable, read_bytes
from spark_torch_est.core import jvm, support
from spark_torch_est.core.duration import Duration
from spark_torch_est.core.progress import Interval, Parent, Progress, Target
from spark_torch_est.core.running import fit_logger
from spark_torch_est.core.schema import InputSchema
from spark_torch_est.core.spec import ColumnNames, FileSource, TaskSpec, placed_by
from spark_torch_est.errors import IncompatibleCheckpointError, InvalidInputError
from spark_torch_est.ingest.frames import (
    check_inputs,
    frame_outputs,
    input_schema,
    staging_frame,
    training_columns,
    training_frame,
)
from spark_torch_est.ingest.parquet_plan import parquet_source
from spark_torch_est.model import TorchModel
from spark_torch_est.params.base import EstimatorParams
from spark_torch_est.params.table import ESTIMATOR_PARAMS, ParamSpec, to_config, to_trainer_args
from spark_torch_est.train.creators import CreatorError, Creators
from spark_torch_est.train.hooks import HookSet, normalize_hooks
from spark_torch_est.train.lightning import NAMESPACES, check_release, namespace_of
from spark_torch_est.train.losses import check_weighted
from spark_torch_est.train.metrics import check_metrics
from spark_torch_est.train.strategies import STRATEGIES, Strategy
from spark_torch_est.train.strategies.fsdp import check_present

__all__ = ["FitPlan", "plan_fit", "plan_frame", "check_static", "check_params", "check_bounds", "check_changes",
           "check_creators", "strategy_of", "task_spec", "make_creators", "checked_config", "checked_trainer_args",
           "lightning_of", "check_lightning", "resolve_checkpoint", "run_of", "release_claim", "check_resumable"]

logger = fit_logger()


@dataclass(frozen=True)
class FitPlan:
    """What a fit launches.

    Attributes:
        progress: Where the run starts.
        target: Where it stops.
        schema: The model's inputs in the DataFrame.
        frame: The job's DataFrame (one empty-handed row per rank when ``source`` is set).
        source: The Parquet files the ranks read themselves, or None.
        spec: The frozen spec every task gets.
        staging: The training columns in the DataFrame's own partitions, which a staging
            job may write out for the ranks instead of the frame's shuffle (see
            :func:`frames.staging_frame`), or None.
    """

    progress: Progress
    target: Target
    schema: InputSchema
    frame: DataFrame
    source: FileSource | None
    spec: TaskSpec
    staging: DataFrame | None = None


def plan_fit(params: EstimatorParams, creators: Creators, dataset: DataFrame, duration: str | Duration | None,
             start: Checkpoint | None, fresh_hooks: frozenset[str] | set[str],
             own: Checkpoint | None = None, like: FitPlan | None = None) -> FitPlan:
    """Checks a fit of ``dataset`` from ``start`` (None: a new run) and plans it.

    Args:
        params: The estimator, for its Params.
        creators: Its creators with the config Param (what the tasks build from).
        dataset: The training DataFrame.
        duration: More training to do (None: up to ``maxEpochs``).
        start: The checkpoint the fit continues, or None.
        fresh_hooks: Names of the hooks added since the last fit (they keep their own state).
        own: The estimator's own checkpoint (its run's newest point), or None (see :func:`run_of`).
        like: The plan of a new run on the same DataFrame whose Params make the same
            training frame (another map of a tuner's split, see
            :mod:`spark_torch_est.together`): its input schema and frame are taken
            as they are, and only the creators are checked.
    """
    check_static(dataset)
    progress = start.progress if start is not None else Progress()
    check_params(params)
    if not _gpu_ranks(params, dataset):
        for feature in strategy_of(params).needs_on_cpu:
            support.require(feature)
    check_changes(params, start)
    check_resumable(start)
    target = Target.after(progress, Duration.parse(duration) if duration is not None else None,
                          params.getMaxEpochs())
    if like is not None:
        check_creators(params, creators, start)
        schema, frame, source, ordered, staging = like.schema, like.frame, like.source, like.spec.ordered, like.staging
    else:
        schema = input_schema_of(params, dataset)
        if start is not None:
            check_inputs(dataset.schema, start.input_schema, schema)
        frame, source, ordered, staging = _checked_frame(params, creators, dataset, schema, start)
    run_id, parent = run_of(start, own, params.getCheckpointDir())
    spec = task_spec(params, creators, target, schema, start, source, fresh_hooks, run_id=run_id, parent=parent,
                     ordered=ordered)
    return FitPlan(progress, target, schema, frame, source, spec, staging)


def check_static(dataset: DataFrame) -> None:
    """Refuses a streaming DataFrame: training passes over a fixed set of rows, epoch after epoch."""
    if dataset.isStreaming:
        raise InvalidInputError(
            "fit needs a static DataFrame, got a streaming one (dataset.isStreaming is True): every epoch trains on "
            "the same fixed rows. transform supports streaming DataFrames, fit does not; train on a stream's rows "
            "by writing them out (e.g. in writeStream.foreachBatch) and passing the table read statically "
            "(spark.read.parquet(...) or spark.read.table(...)) to fit")


def check_params(params: EstimatorParams) -> None:
    """Refuses values no fit can run with: the bounds the Param table declares (see
    :func:`check_bounds`), those between Params, what the strategy needs (see
    :class:`~spark_torch_est.train.strategies.base.Strategy`), a checkpointDir the driver
    cannot write."""
    for spec in ESTIMATOR_PARAMS:
        check_bounds(spec, params.getOrDefault(spec.name))
    fewest, high = params.getMinWorkers(), params.getNumWorkers()
    if fewest is not None and not 1 <= fewest <= high:
        raise InvalidInputError(f"minWorkers must be between 1 and numWorkers={high} (or None for numWorkers), "
                                f"got {fewest}")
    strategy = strategy_of(params)
    for feature in strategy.needs:
        support.require(feature)
    if is_remote():
        support.require(support.CONNECT_ML)
    directory = params.getCheckpointDir()
    strategy.check_settings(directory)
    Interval.parse(params.getCheckpointInterval())
    if directory:
        try:
            probe_writable(directory)
        except (OSError, ValueError, ImportError) as error:  # read-only, missing mount, unknown URL scheme
            raise InvalidInputError(f"checkpointDir={directory!r} cannot be written from the driver "
                                    f"({type(error).__name__}: {error}); point it at a writable directory the "
                                    "executors share, or unset it") from None


def _gpu_ranks(params: EstimatorParams, dataset: DataFrame) -> bool:
    """Whether the ranks will train on GPUs: ``useGpu=True``, or None with GPUs given to the
    tasks (``spark.task.resource.gpu.amount``)."""
    if params.getUseGpu() is not None:
        return bool(params.getUseGpu())
    return dataset.sparkSession.conf.get("spark.task.resource.gpu.amount", None) not in (None, "0")


def check_bounds(spec: ParamSpec, value: Any) -> None:
    """Refuses a ``value`` of the Param ``spec`` outside the bounds its row in the table
    declares (``minimum``, ``seconds``, ``choices``).

    Raises:
        InvalidInputError: Names the Param, its bound and the value received.
    """
    if spec.minimum is not None and value < spec.minimum:
        raise InvalidInputError(f"{spec.name} must be at least {spec.minimum}, got {value}")
    if spec.seconds and not value > 0:
        raise InvalidInputError(f"{spec.name} must be a positive number of seconds, got {value}")
    if spec.choices is not None:
        choices = _choices(spec.choices)
        if value not in choices:
            raise InvalidInputError(f"{spec.name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _choices(where: str) -> Collection[str]:
    """The collection ``"module:NAME"`` (a ``choices`` of the table) names."""
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def strategy_of(params: EstimatorParams) -> type[Strategy]:
    """The class of the strategy the ``strategy`` Param names.

    Raises:
        InvalidInputError: It names none (as :func:`check_bounds` says it).
    """
    check_bounds(next(spec for spec in ESTIMATOR_PARAMS if spec.name == "strategy"), params.getStrategy())
    return STRATEGIES[params.getStrategy()]


def check_changes(params: EstimatorParams, start: Checkpoint | None) -> None:
    """Refuses the changes since ``start`` that the next fit could not honor exactly."""
    if start is not None and start.strategy != params.getStrategy():
        raise InvalidInputError(
            f"strategy changed from {start.strategy!r} to {params.getStrategy()!r} within a run: its optimizer "
            f"state is kept {'sharded' if _sharded(start.strategy) else 'whole'} and cannot be carried over; "
            f"keep strategy={start.strategy!r}, or call est.reset() to start a new run")
    if start is None or start.progress.sample_in_epoch == 0 or start.seed == params.getSeed():
        return
    raise InvalidInputError(
        f"seed changed from {start.seed} to {params.getSeed()} in the middle of epoch {start.progress.epoch + 1}: "
        "the rest of that epoch would be shuffled anew, training some rows twice and others not at all. Finish "
        f"the epoch with seed={start.seed} first (fit(df, duration=...) up to its end), then change the seed; "
        "or call est.reset() to start a new run"
    )


def _sharded(strategy: str) -> bool:
    """Whether a run under ``strategy`` (a checkpoint's) keeps its state in parts."""
    known = STRATEGIES.get(strategy)
    return known is not None and known.sharded


def run_of(start: Checkpoint | None, own: Checkpoint | None, checkpoint_dir: str | None) -> tuple[str, Parent | None]:
    """The run a fit from ``start`` trains, and the point it branched from.

    A fit continues the run of ``start`` (its id and parent) only from that run's newest
    point: ``start`` is of the estimator's own run (``own``), no older than ``own``, ``own``
    (this copy of the run) claims the point in ``checkpoint_dir`` (an atomic claim: of two
    estimators loaded from one save, only one continues the run there), and
    ``checkpoint_dir`` holds no newer checkpoint of the run (a failed fit may have written
    some). Any other start (another run's model or checkpoint, one in a fresh estimator, an
    earlier point of this run) begins a new run, a branch whose parent is ``start``'s point:
    its files never meet those of the run it came from.

    Returns:
        ``(run id, parent)``; a fresh run (``start`` None) has no parent.
    """
    if start is None:
        return uuid.uuid4().hex, None
    step = start.progress.global_step
    if own is not None and start.run_id == own.run_id and step >= own.progress.global_step:
        directory = CheckpointDir(checkpoint_dir, run_id=start.run_id) if checkpoint_dir else None
        if directory is None or directory.claim(step, own.holder):
            newest = directory.newest() if directory is not None else None
            if newest is None or newest.global_step <= step:
                return start.run_id, start.parent
    return uuid.uuid4().hex, Parent(start.run_id, step)


def release_claim(start: Checkpoint | None, own: Checkpoint | None, checkpoint_dir: str | None) -> None:
    """Gives back the claim :func:`run_of` may have taken for a fit that then failed or was
    refused, so a later copy of the run (loaded from the same save) continues it rather than
    branching. Storage errors are logged: the fit's own error is the one to raise."""
    if start is None or own is None or not checkpoint_dir or start.run_id != own.run_id:
        return
    try:
        CheckpointDir(checkpoint_dir, run_id=start.run_id).release(start.progress.global_step, own.holder)
    except OSError as error:
        logger.warning("could not give back the claim on %s in checkpointDir: %s", start.progress, error)


def check_resumable(start: Checkpoint | None) -> None:
    """Refuses, before any job, a sharded ``start`` whose folder is gone or altered.

    Raises:
        IncompatibleCheckpointError: Names the folder and the fix.
    """
    if start is None or start.sharded is None:
        return
    try:
        check_present(start.sharded)
    except IncompatibleCheckpointError as error:
        raise IncompatibleCheckpointError(
            f"cannot continue from {start!r} of run {start.run_id[:12]}: {error}. Continue from a model saved "
            "with TorchModel.save (it carries its sharded state: TorchModel.load(path) for resume_from), or from "
            "a newer checkpoint of the run (resume_from=checkpointDir)") from None


def lightning_of(creators: Creators) -> str | None:
    """The Lightning package of the model when it is a LightningModule (an instance, or what
    its creator returns), else None. Imports nothing: without Lightning imported, no model is
    a LightningModule and a creator is not called here."""
    if creators.model is None or not any(name in sys.modules for name in NAMESPACES):
        return None
    if isinstance(creators.model, torch.nn.Module):
        return namespace_of(creators.model)
    try:
        return namespace_of(creators.build_model())
    except CreatorError as error:
        raise InvalidInputError(f"{error} (check the model= argument)") from error


def check_lightning(params: EstimatorParams, creators: Creators, namespace: str, start: Checkpoint | None) -> None:
    """Refuses, before any job, what a LightningModule's fit cannot take: creators its own
    methods replace, strategies and Params its Trainer does not run, a Lightning release the
    installed torch cannot carry, callbacks that are not Lightning callbacks, and a checkpoint
    that is not a LightningModule's run."""
    try:
        check_release(namespace)
    except ValueError as error:
        raise InvalidInputError(str(error)) from None
    for name in ("optimizer", "loss", "scheduler", "metrics", "hooks"):
        if getattr(creators, name):
            raise InvalidInputError(
                f"{name}= is given with a LightningModule as the model ({type(creators.model).__name__}): the module "
                "trains itself (configure_optimizers makes its optimizers and schedulers, training_step its loss, "
                "self.log its metrics; Lightning callbacks in callbacks=[...] take the place of hooks); drop "
                f"{name}=")
    trainer_class = getattr(sys.modules[namespace], "Trainer", None)
    if trainer_class is not None:
        known = inspect.signature(trainer_class).parameters
        unknown = [key for key in params.getTrainerArgs() if key not in known]
        if unknown:
            raise InvalidInputError(f"trainerArgs {unknown[0]!r} is not an argument of {namespace}.Trainer "
                                    f"(its arguments: {', '.join(sorted(known))})")
    if params.getStrategy() != "ddp" or params.getCompileModel():
        raise InvalidInputError(
            f"a LightningModule trains with strategy='ddp' and compileModel=False, got strategy="
            f"{params.getStrategy()!r}, compileModel={params.getCompileModel()}")
    callback_class = getattr(sys.modules[namespace], "Callback", None)
    for callback in creators.callbacks:
        if callback_class is not None and not isinstance(callback, callback_class):
            raise InvalidInputError(f"callbacks must be {namespace}.Callback instances, got "
                                    f"{type(callback).__name__}")
    if start is not None and start.lightning_state is None:
        raise InvalidInputError(
            "the fit would continue a checkpoint that a plain module's fit wrote (it holds no Lightning state): "
            "call est.reset() to start a new run with the LightningModule")
    try:
        model = creators.build_model()
        if start is not None and start.model_state:
            check_compatible(model.state_dict(), start.model_state)
    except CreatorError as error:
        raise InvalidInputError(f"{error} (check the model= argument)") from error


def check_creators(params: EstimatorParams, creators: Creators, start: Checkpoint | None) -> None:
    """Builds every object once on the driver, so bad creators fail before any job."""
    namespace = lightning_of(creators)
    if creators.callbacks and namespace is None:
        raise InvalidInputError("callbacks= are Lightning callbacks: they need a LightningModule as the model; use "
                                "hooks= for a plain module")
    if namespace is not None:
        check_lightning(params, creators, namespace, start)
        return
    for name in ("model", "optimizer", "loss"):
        if getattr(creators, name) is None:
            raise InvalidInputError(f"TorchEstimator needs {name}=...; it is None")
    HookSet(creators.hooks).state_dict()  # a state the checkpoint cannot store fails here, not after an epoch
    strategy = strategy_of(params)
    try:
        model = strategy.model_to_check(creators)
        strategy.check_model(model, params.getShardModules())
        if start is not None and start.model_state:  # a sharded checkpoint's own .pt holds no weights
            check_compatible(model.state_dict(), start.model_state)
        creators.build_scheduler(creators.build_optimizer(model))
        loss = creators.build_loss()
    except CreatorError as error:
        raise InvalidInputError(f"{error} (check the {error.creator}= argument)") from error
    if params.getWeightCol():
        try:
            check_weighted(loss)
        except ValueError as error:
            raise InvalidInputError(f"{error} (weightCol={params.getWeightCol()!r})") from None


def input_schema_of(params: EstimatorParams, dataset: DataFrame) -> InputSchema:
    """The model's inputs in ``dataset`` (see :func:`frames.input_schema`)."""
    return input_schema(dataset.schema, features_col=params.getFeaturesCol(), feature_cols=params.getFeatureCols(),
                        input_cols=params.getInputCols(), input_shapes=params.getInputShapes(),
                        padding_value=params.getPaddingValue())


class _FrameColumns(TypedDict):
    """The inputs and the columns that make the training frame, as :func:`frames.training_columns`
    and :func:`frames.frame_outputs` take them."""

    schema: InputSchema
    features_col: str | None
    feature_cols: list[str] | None
    label_col: str
    validation_col: str | None
    weight_col: str | None


def plan_frame(params: EstimatorParams, dataset: DataFrame, schema: InputSchema, workers: int,
               partitions: int | None) -> tuple[DataFrame, FileSource | None]:
    """The training frame of a job of ``workers`` ranks, and the Parquet files they read
    themselves (None: the rows come through the frame, in ``partitions`` logical partitions
    when the ranks place them by their order, else None, see :func:`frames.training_frame`).

    Raises:
        InvalidInputError: A column is missing or has an unusable type.
    """
    columns = training_columns(dataset, **_frame_columns(params, schema))
    source = _direct_source(params, dataset, schema, workers)
    if source is not None:
        return dataset.sparkSession.range(0, workers, 1, workers), source
    return training_frame(dataset, columns, workers, partitions), None


def _frame_columns(params: EstimatorParams, schema: InputSchema) -> _FrameColumns:
    return _FrameColumns(schema=schema, features_col=params.getFeaturesCol(), feature_cols=params.getFeatureCols(),
                         label_col=params.getLabelCol(), validation_col=params.getValidationIndicatorCol(),
                         weight_col=params.getWeightCol())


def _direct_source(params: EstimatorParams, dataset: DataFrame, schema: InputSchema, workers: int) -> FileSource | None:
    """The Parquet files the ranks read themselves (``directRead`` and a plain table), or None."""
    if not params.getDirectRead():
        return None
    return parquet_source(dataset, frame_outputs(dataset, **_frame_columns(params, schema)), workers)


def in_order(dataset: DataFrame, start: Checkpoint | None) -> bool:
    """Whether the rows of a fit through Spark are placed in the run by the order Spark
    gives them (see :mod:`spark_torch_est.ingest.canonical`): unless the DataFrame's order
    changes between jobs, or the fit continues an epoch whose rows were placed by hashing
    (it goes on exactly as it began). The fit's log says when the ranks hash, and why."""
    if start is not None and start.progress.sample_in_epoch and placed_by(start.data_source) == "hash":
        logger.info("the rows are placed by hashing them, as in the epoch this fit continues")
        return False
    unstable = jvm.order_unstable(dataset)
    if unstable is not None:
        logger.info("the rows are placed in the run by hashing them at each launch (about 1 s per million rows of "
                    "32 floats a rank): the DataFrame's order may change between Spark jobs, as %s; cache it or "
                    "write it to files to skip this", unstable)
        return False
    return True


def _checked_frame(params: EstimatorParams, creators: Creators, dataset: DataFrame, schema: InputSchema,
                   start: Checkpoint | None) -> tuple[DataFrame, FileSource | None, bool, DataFrame | None]:
    """Checks the creators and plans the training frame side by side: the JVM plans the
    frame (slow in a fresh session) while Python builds the model and optimizer (the first
    optimizer in a process imports ``torch._dynamo``, which is slow too). A creator error
    wins over a column error. Under Spark Connect the client plans nothing, so both run in
    turn. A plain Parquet table is read by the ranks themselves (see
    :mod:`spark_torch_est.ingest.parquet_plan`): the job's frame is then one empty-handed row
    per rank. Also says whether rows through Spark come in order (see :func:`in_order`), and
    what a staging job may write instead of the frame's shuffle (see :func:`frames.staging_frame`)."""
    def plan() -> tuple[DataFrame, FileSource | None, bool, DataFrame | None]:
        workers = params.getNumWorkers()
        columns = training_columns(dataset, **_frame_columns(params, schema))
        source = _direct_source(params, dataset, schema, workers)
        if source is not None:
            return dataset.sparkSession.range(0, workers, 1, workers), source, False, None
        ordered = in_order(dataset, start)
        partitions = (start.shards if start is not None else workers) if ordered else None
        staging = None if is_remote() else staging_frame(dataset, columns, workers, partitions)  # files need hosts
        return training_frame(dataset, columns, workers, partitions), None, ordered, staging

    if is_remote():
        check_creators(params, creators, start)
        return plan()
    as_caller = jvm.in_caller_properties(dataset.sparkSession.sparkContext)  # the caller's job group, pool, ...

    def plan_here() -> tuple[DataFrame, FileSource | None, bool, DataFrame | None]:
        as_caller()
        return plan()

    with ThreadPoolExecutor(1, thread_name_prefix="spark_torch_est-plan") as pool:
        planned = pool.submit(plan_here)
        check_creators(params, creators, start)
        return planned.result()


def task_spec(params: EstimatorParams, creators: Creators, target: Target, schema: InputSchema,
              start: Checkpoint | None, source: FileSource | None,
              fresh_hooks: frozenset[str] | set[str] = frozenset(), *, run_id: str | None = None,
              parent: Parent | None = None, ordered: bool = False) -> TaskSpec:
    """The spec of the fit's tasks: the creators cloudpickled, the Params as plain data;
    ``run_id`` and ``parent`` as :func:`run_of` gives them (None: a new run); ``ordered``:
    rows through Spark placed by their order (see :func:`in_order`)."""
    try:
        payload = cloudpickle.dumps(creators)
    except Exception as error:
        raise InvalidInputError(
            f"the creators, hooks or config cannot be pickled for the executors: {type(error).__name__}: {error}"
        ) from error
    budget, shards = params.getMemoryBudgetMB(), params.getShardModules()
    return TaskSpec(
        run_id=run_id or uuid.uuid4().hex, fit_id=uuid.uuid4().hex, payload=payload, parent=parent,
        resume=start.for_ranks().to_bytes() if start is not None else None, target=target, schema=schema,
        world_size=params.getNumWorkers(), batch_size=params.getBatchSize(), seed=params.getSeed(),
        timeout_s=params.getTimeout(), use_gpu=params.getUseGpu(), checkpoint_dir=params.getCheckpointDir(),
        checkpoint_every=Interval.parse(params.getCheckpointInterval()),
        columns=ColumnNames(label=params.getLabelCol(), weight=params.getWeightCol(),
                        features=tuple(params.getFeatureCols() or ()) or None),
        memory_budget=int(budget * (1 << 20)) if budget else None,
        allow_non_finite=params.getAllowNonFinite(), fresh_hooks=tuple(sorted(fresh_hooks)), source=source,
        precision=params.getPrecision(), compile_model=params.getCompileModel(), strategy=params.getStrategy(),
        shard_modules=tuple(shards) if shards is not None else None,
        lightning={"trainer_args": params.getTrainerArgs(), "max_epochs": params.getMaxEpochs()}
        if lightning_of(creators) is not None else None,
        ordered=ordered, shards=start.shards if start is not None else None,
    )


def make_creators(*, model: Any = None, optimizer: Any = None, loss: Any = None, scheduler: Any = None,
                  metrics: Mapping[str, Any] | None = None, hooks: Any = None, callbacks: Any = None) -> Creators:
    """The creators of ``TorchEstimator(...)``, each checked to be of a kind that can work."""
    for name, value in (("optimizer", optimizer), ("scheduler", scheduler)):
        if value is not None and not callable(value):
            raise InvalidInputError(f"{name} must be a callable creator, got {type(value).__name__}")
    if model is not None and not (isinstance(model, torch.nn.Module) or callable(model)):
        raise InvalidInputError(f"model must be an nn.Module or a callable(config), got {type(model).__name__}")
    if loss is not None and not callable(loss):
        raise InvalidInputError(f"loss must be an nn.Module or a callable(outputs, labels), got {type(loss).__name__}")
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        raise InvalidInputError(f"callbacks must be a list of Lightning callbacks, got {type(callbacks).__name__}")
    return Creators(model=model, optimizer=optimizer, loss=loss, scheduler=scheduler,
                    metrics=check_metrics(metrics), hooks=normalize_hooks(hooks), callbacks=list(callbacks or []))


def checked_config(config: Any) -> dict[str, Any]:
    """``config`` as the config Param takes it, or an InvalidInputError naming config."""
    try:
        return to_config(config)
    except TypeError as error:
        raise InvalidInputError(str(error)) from None


def checked_trainer_args(args: Any) -> dict[str, Any]:
    """``args`` as the trainerArgs Param takes it, or an InvalidInputError naming trainerArgs."""
    try:
        return to_trainer_args(args)
    except TypeError as error:
        raise InvalidInputError(str(error)) from None


def resolve_checkpoint(source: Any) -> Checkpoint:
    """The checkpoint behind ``resume_from``: a Checkpoint, a TorchModel's, a checkpoint
    file, or the newest one a checkpointDir's ``latest`` pointer names."""
    if isinstance(source, Checkpoint):
        return source
    if isinstance(source, TorchModel):
        return source.checkpoint
    if isinstance(source, str):
        try:
            latest = CheckpointDir(source).latest()
            blob = read_bytes(latest.url if latest is not None else source)
        except (OSError, ValueError) as error:  # missing, unreadable, or an unknown URL scheme
            raise InvalidInputError(
                f"resume_from={source!r}: cannot read it ({type(error).__name__}: {error}); pass the path or URL of "
                "a checkpoint file (a ckpt-*.pt in checkpointDir, or one written by Checkpoint.save), a "
                "checkpointDir, a TorchModel or a Checkpoint"
            ) from error
        return Checkpoint.from_bytes(blob)
    raise InvalidInputError(
        f"resume_from must be a TorchModel, a Checkpoint or a checkpoint path, got {type(source).__name__}"
    )
