"""[driver] The one table of the Params of TorchEstimator, TorchModel and SuccessiveHalving, and the
converters it names.

Every Param is one :class:`ParamSpec` row of :data:`PARAMS`: name, doc, type, converter,
default and family. Everything else comes from the table: ``python -m
spark_torch_est.params.codegen`` (``make params``) writes the typed Param declarations, their
defaults and their ``getX``/``setX`` accessors into one module per family (``params/columns.py``,
``params/training.py``, ``params/runtime.py``, and the tuner's ``tuning/halving_params.py``),
their bounds are checked before a fit (see ``minimum``, ``seconds``, ``choices`` of
:class:`ParamSpec`), and tests/unit/params/test_table.py checks that those
modules are up to date and that ``TorchEstimator``'s signature and docstring agree with the
table. docs/params.md says how to add a Param.

>>> [spec.default for spec in PARAMS if spec.name in ("batchSize", "maxEpochs")]
[64, 10]
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark.ml.param import TypeConverters

__all__ = ["Family", "ParamSpec", "FAMILIES", "PARAMS", "to_config", "to_trainer_args", "TRAINER_OWNED",
           "to_optional_bool", "to_optional_int", "to_optional_string", "to_optional_string_list", "to_shapes"]


def to_optional_bool(value: object) -> bool | None:
    """None, or ``value`` as a bool (as ``TypeConverters.toBoolean``)."""
    return None if value is None else TypeConverters.toBoolean(value)


def to_optional_int(value: object) -> int | None:
    """None, or ``value`` as an int (as ``TypeConverters.toInt``)."""
    return None if value is None else TypeConverters.toInt(value)


def to_optional_string(value: object) -> str | None:
    """None, or ``value`` as a str (as ``TypeConverters.toString``)."""
    return None if value is None else TypeConverters.toString(value)


def to_optional_string_list(value: object) -> list[str] | None:
    """None, or ``value`` as a list of str (as ``TypeConverters.toListString``)."""
    return None if value is None else TypeConverters.toListString(value)


def to_shapes(value: object) -> dict[str, list[int]] | None:
    """``{column: [sizes]}``, JSON-serializable; None for no reshaping."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"inputShapes must be a dict of column name -> list of sizes, got {type(value).__name__}")
    return {str(name): TypeConverters.toListInt(shape) for name, shape in value.items()}


def to_config(value: object) -> dict[str, Any]:
    """A copy of a config dict (None is ``{}``), checked to be a plain JSON-serializable dict,
    as every Param value is (so estimators save their Params as JSON and tuners vary it).

    Raises:
        TypeError: ``value`` is not a dict, or not JSON-serializable; the message shows it.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"config must be a dict, got {type(value).__name__}: {value!r}"[:500])
    try:
        json.dumps(dict(value), allow_nan=True)
    except (TypeError, ValueError) as error:
        raise TypeError(f"config must be a plain dict of JSON values (numbers, strings, booleans, None, lists, "
                        f"dicts with string keys), so it saves with the Params; got {dict(value)!r} ({error}). "
                        "Pass a name in config and look the object up in your creator"[:1000]) from None
    return copy.deepcopy(dict(value))


def to_trainer_args(value: object) -> dict[str, Any]:
    """A copy of a ``trainerArgs`` dict (None is ``{}``): JSON values, as ``config``, and none of
    the Trainer arguments the estimator sets itself.

    Raises:
        TypeError: ``value`` is not a plain dict, or it sets an argument the estimator owns
            (the message names the key and what sets it).
    """
    if value is None:
        return {}
    try:
        args = to_config(value)
    except TypeError as error:
        raise TypeError(str(error).replace("config must", "trainerArgs must", 1)) from None
    for key in args:
        if key in TRAINER_OWNED:
            raise TypeError(f"trainerArgs may not set {key!r}: the estimator sets it ({TRAINER_OWNED[key]})")
    return args


#: Lightning Trainer arguments the estimator sets itself, and the Param or argument that sets each.
TRAINER_OWNED = {
    "accelerator": "useGpu", "devices": "numWorkers (one device per rank)", "num_nodes": "numWorkers",
    "strategy": "the estimator (DDP on the task's process group)", "plugins": "the estimator",
    "max_epochs": "maxEpochs and fit(duration=...)", "min_epochs": "maxEpochs and fit(duration=...)",
    "max_steps": "fit(duration='Nba')", "min_steps": "fit(duration='Nba')", "max_time": "fit(duration=...)",
    "use_distributed_sampler": "the estimator: rows come in the run's exactly-once order",
    "limit_train_batches": "fit(duration=...)", "overfit_batches": "fit(duration=...)",
    "fast_dev_run": "fit(duration=...)", "precision": "the precision Param", "callbacks": "callbacks=[...]",
    "logger": "loggers=[...], on the driver", "reload_dataloaders_every_n_epochs": "the estimator",
}


@dataclass(frozen=True)
class Family:
    """Params generated into one mixin class, in one module.

    Attributes:
        cls: The mixin's name, e.g. ``"TrainingParams"``.
        module: Its module in ``folder``, e.g. ``"training"`` (``params/training.py``).
        doc: What its Params are about (the mixin's and the module's docstring).
        carried_by: The stages whose class declares them (a fitted TorchModel holds the
            values its estimator had, see :func:`spark_torch_est.params.base.carry_params`).
        type_imports: Imports the accessors' annotations need (for type checkers only).
        folder: The package's folder of the module: ``params``, or the folder of the stage that
            alone carries them (the tuner's beside the tuner, as pyspark's ``ml/tuning.py``).
    """

    cls: str
    module: str
    doc: str
    carried_by: tuple[str, ...]
    type_imports: tuple[str, ...] = ()
    folder: str = "params"


@dataclass(frozen=True)
class ParamSpec:
    """One Param.

    Attributes:
        name: camelCase, as Spark ML names Params; the accessors are ``get<Name>``/``set<Name>``.
        doc: The Param's doc (lower case, no final period, as pyspark's).
        type: The value's type as the accessors annotate it, e.g. ``"int | None"``.
        converter: The Param's ``typeConverter``: a ``TypeConverters`` method or a converter
            of this module.
        default: The default value (JSON-serializable, as every Param value).
        family: A key of :data:`FAMILIES`.
        copy: ``get<Name>`` returns a deep copy (a mutable value, e.g. config).
        required: No default: the user sets it before fitting (``default`` is then None).
        minimum: The least value a fit takes (None: no bound).
        seconds: A duration in seconds: a fit takes only a value above 0.
        choices: The values a fit takes, as ``"module:NAME"`` of the collection that holds
            them beside the code that implements them (e.g. the strategies' registry), or None.

    The driver checks ``minimum``, ``seconds`` and ``choices`` before any job
    (:func:`spark_torch_est.planning.check_bounds`); bounds that relate two Params stay in
    ``planning.check_params``.
    """

    name: str
    doc: str
    type: str
    converter: Callable[[Any], Any]
    default: object
    family: str
    copy: bool = False
    required: bool = False
    minimum: float | None = None
    seconds: bool = False
    choices: str | None = None


FAMILIES: dict[str, Family] = {
    "columns": Family("ColumnParams", "columns",
                      "the columns a model reads and writes, and how transform reads them",
                      ("TorchEstimator", "TorchModel")),
    "training": Family("TrainingParams", "training",
                       "what is trained, on which rows, and how", ("TorchEstimator", "TorchModel")),
    "runtime": Family("RuntimeParams", "runtime",
                      "where and how a fit runs: ranks, slots, retries, checkpoints, memory, progress",
                      ("TorchEstimator", "TorchModel")),
    "halving": Family("HalvingParams", "halving_params",
                      "what successive halving tunes and how its rungs keep and train configurations",
                      ("SuccessiveHalving",),
                      ("from pyspark.ml.evaluation import Evaluator",
                       "from spark_torch_est.estimator import TorchEstimator"), folder="tuning"),
}

_T = TypeConverters

PARAMS: tuple[ParamSpec, ...] = (
    # ---- columns: TorchEstimator and TorchModel
    ParamSpec("featuresCol", "Vector, array<numeric> or numeric column; None to use featureCols",
              "str | None", to_optional_string, "features", "columns"),
    ParamSpec("featureCols", "numeric columns to use as features, instead of featuresCol",
              "list[str] | None", to_optional_string_list, None, "columns"),
    ParamSpec("inputCols", "columns given to the model as separate typed inputs, model(*inputs), in this order "
              "(instead of featuresCol/featureCols): integers as int64 (ids stay exact), floats as float32, booleans, "
              "binary as uint8, arrays and Vectors with their shapes, arrays of different lengths padded per batch",
              "list[str] | None", to_optional_string_list, None, "columns"),
    ParamSpec("labelCol", "label column; integer labels with several outputs are class indices",
              "str", _T.toString, "label", "columns"),
    ParamSpec("weightCol", "numeric column of per-row sample weights: losses and metrics become weighted means; "
              "None = unweighted", "str | None", to_optional_string, None, "columns"),
    ParamSpec("predictionCol", "output column of the model; for classifiers (integer labels, several outputs) the "
              "class index", "str", _T.toString, "prediction", "columns"),
    ParamSpec("rawPredictionCol", "for classifiers (integer labels, several outputs): Vector column of the model's "
              "outputs (logits); '' = omit", "str", to_optional_string, "rawPrediction", "columns"),
    ParamSpec("probabilityCol", "for classifiers (integer labels, several outputs): Vector column of the softmax of "
              "the outputs; '' = omit", "str", to_optional_string, "probability", "columns"),
    ParamSpec("inferenceBatchSize", "rows per forward pass in transform()", "int", _T.toInt, 4096, "columns",
              minimum=1),
    ParamSpec("directRead", "a plain Parquet table on a local or mounted filesystem is read by the tasks themselves "
              "with pyarrow, not through the JVM: in fit; in evaluate, and in transform where a join's broadcast "
              "decision stays as on the table, when pyarrow reads its columns exactly as Spark would pass them "
              "(False: always through Spark)", "bool", _T.toBoolean, True, "columns"),
    # ---- training: TorchEstimator
    ParamSpec("config", "plain dict handed to every creator (model, optimizer, scheduler); JSON values only",
              "dict[str, Any]", to_config, {}, "training", copy=True),
    ParamSpec("batchSize", "rows per worker per step", "int", _T.toInt, 64, "training", minimum=1),
    ParamSpec("maxEpochs", "the run never trains past this many epochs", "int", _T.toInt, 10, "training",
              minimum=1),
    ParamSpec("seed", "seed of initialization, shuffles and RNG streams", "int", _T.toInt, 0, "training"),
    ParamSpec("validationIndicatorCol", "boolean column, True for validation rows; None = no validation",
              "str | None", to_optional_string, None, "training"),
    ParamSpec("inputShapes", "{column: [sizes]}: reshape each row of an inputCols column, e.g. {'image': [1, 8, 8]} "
              "for 64 bytes; None = rows as they are", "dict[str, list[int]] | None", to_shapes, None, "training"),
    ParamSpec("paddingValue", "what arrays shorter than the longest row of their batch are padded with",
              "float", _T.toFloat, 0.0, "training"),
    ParamSpec("allowNonFinite", "train on when the loss is NaN or infinite (default False: the fit fails at that "
              "step and the run keeps its last good state)", "bool", _T.toBoolean, False, "training"),
    ParamSpec("precision", "'32' (float32), 'bf16-mixed' (bfloat16 autocast) or '16-mixed' (float16 autocast and a "
              "gradient scaler): the forward pass and loss of training, validation, evaluate and transform; weights "
              "stay float32", "str", _T.toString, "32", "training",
              choices="spark_torch_est.train.precision:PRECISIONS"),
    ParamSpec("compileModel", "compile each rank's model with torch.compile (one graph per batch shape)",
              "bool", _T.toBoolean, False, "training"),
    ParamSpec("strategy", "'ddp' (every rank holds the whole model) or 'fsdp' (FSDP2: each rank holds its shard of "
              "the parameters and optimizer state; sharded checkpoints; needs checkpointDir)",
              "str", _T.toString, "ddp", "training", choices="spark_torch_est.train.strategies:STRATEGIES"),
    ParamSpec("shardModules", "with strategy='fsdp': class names of the submodules sharded on their own before the "
              "root, e.g. ['TransformerBlock']; None = every direct child holding parameters",
              "list[str] | None", to_optional_string_list, None, "training"),
    ParamSpec("trainerArgs", "with a LightningModule as the model: more arguments of Lightning's Trainer, e.g. "
              "{'gradient_clip_val': 1.0}; JSON values only; not those the estimator sets (devices, num_nodes, "
              "strategy, max_epochs, ...)", "dict[str, Any]", to_trainer_args, {}, "training", copy=True),
    # ---- runtime: TorchEstimator
    ParamSpec("numWorkers", "barrier tasks, i.e. DDP ranks", "int", _T.toInt, 2, "runtime", minimum=1),
    ParamSpec("minWorkers", "fewest ranks a launch may train with when fewer than numWorkers task slots are free "
              "after slotWaitTimeout (the global batch stays batchSize * numWorkers); None = numWorkers (no "
              "elasticity)", "int | None", to_optional_int, None, "runtime"),
    ParamSpec("useGpu", "True/False, or None to use GPUs when tasks have them",
              "bool | None", to_optional_bool, None, "runtime"),
    ParamSpec("timeout", "seconds before a rendezvous or collective that does not complete fails the fit",
              "float", _T.toFloat, 600.0, "runtime", seconds=True),
    ParamSpec("slotWaitTimeout", "seconds to wait for executors to offer numWorkers task slots",
              "float", _T.toFloat, 60.0, "runtime", seconds=True),
    ParamSpec("maxRetries", "relaunches of a failed job from the newest checkpoint", "int", _T.toInt, 1, "runtime",
              minimum=0),
    ParamSpec("checkpointDir", "fsspec URL for periodic checkpoints (None = only the driver's copy)",
              "str | None", to_optional_string, None, "runtime"),
    ParamSpec("checkpointInterval", "how often to write to checkpointDir, e.g. '1ep' or '500ba'",
              "str", _T.toString, "1ep", "runtime"),
    ParamSpec("memoryBudgetMB", "MB of a partition's rows a rank keeps in RAM; beyond that they spill to local files "
              "read per batch (0: never spill)", "float", _T.toFloat, 4096.0, "runtime", minimum=0),
    ParamSpec("keepIngestedMB", "MB of a DataFrame's rows each executor keeps on its local disk, as the ranks "
              "received them, so that later fits on the same unchanged DataFrame skip Spark's scan and shuffle; the "
              "least recently used are evicted past it (0: keep nothing)", "float", _T.toFloat, 8192.0, "runtime",
              minimum=0),
    ParamSpec("showProgress", "show a progress bar (a terminal or notebook), else progress and epoch lines on stderr "
              "(through logging where it is set up)", "bool", _T.toBoolean, True, "runtime"),
    # ---- halving: SuccessiveHalving (its seed and parallelism are pyspark's shared Params)
    ParamSpec("estimator", "the TorchEstimator to tune", "TorchEstimator", _T.identity, None, "halving", required=True),
    ParamSpec("estimatorParamMaps", "the param maps to choose from", "list[dict]", _T.identity, None, "halving",
              required=True),
    ParamSpec("evaluator", "scores each configuration on the validation rows (its isLargerBetter decides)",
              "Evaluator", _T.identity, None, "halving", required=True),
    ParamSpec("eta", "each rung keeps the best ceil(n / eta) and trains them eta times as many epochs (at least 2)",
              "int", _T.toInt, 2, "halving"),
    ParamSpec("minDuration", "epochs every configuration trains in rung 0, e.g. '1ep'", "str", _T.toString, "1ep",
              "halving"),
    ParamSpec("trainRatio", "fraction of the rows trained on when the estimator has no validationIndicatorCol (the "
              "rest validate)", "float", _T.toFloat, 0.75, "halving"),
)

#: The Params of TorchEstimator (every family but the tuner's).
ESTIMATOR_PARAMS: tuple[ParamSpec, ...] = tuple(p for p in PARAMS if "TorchEstimator" in FAMILIES[p.family].carried_by)
