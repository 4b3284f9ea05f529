"""[driver] Spark ML Param declarations and their defaults (the one home of every default)."""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, Iterable, Mapping, TypeVar

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (
    HasFeaturesCol,
    HasLabelCol,
    HasPredictionCol,
    HasProbabilityCol,
    HasRawPredictionCol,
    HasSeed,
    HasValidationIndicatorCol,
)

__all__ = ["ModelParams", "EstimatorParams", "ESTIMATOR_DEFAULTS", "MODEL_DEFAULTS", "carry_params", "declare_params",
           "param_map_name", "to_config"]


_P = TypeVar("_P", bound=Params)


def _to_optional_bool(value: object) -> bool | None:
    return None if value is None else TypeConverters.toBoolean(value)


def _to_optional_int(value: object) -> int | None:
    return None if value is None else TypeConverters.toInt(value)


def _to_optional_string(value: object) -> str | None:
    return None if value is None else TypeConverters.toString(value)


def _to_optional_string_list(value: object) -> list[str] | None:
    return None if value is None else TypeConverters.toListString(value)


def _to_shapes(value: object) -> dict[str, list[int]] | None:
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


#: Defaults shared by TorchEstimator and TorchModel.
MODEL_DEFAULTS: dict[str, object] = {
    "featuresCol": "features",
    "labelCol": "label",
    "featureCols": None,
    "inputCols": None,
    "weightCol": None,
    "predictionCol": "prediction",
    "rawPredictionCol": "rawPrediction",
    "probabilityCol": "probability",
    "inferenceBatchSize": 4096,
    "directRead": True,
}

#: Defaults of TorchEstimator's own Params.
ESTIMATOR_DEFAULTS: dict[str, object] = {
    "validationIndicatorCol": None,
    "batchSize": 64,
    "maxEpochs": 10,
    "numWorkers": 2,
    "minWorkers": None,
    "seed": 0,
    "checkpointDir": None,
    "checkpointInterval": "1ep",
    "maxRetries": 1,
    "useGpu": None,
    "timeout": 600.0,
    "slotWaitTimeout": 60.0,
    "showProgress": True,
    "memoryBudgetMB": 4096.0,
    "keepIngestedMB": 8192.0,
    "allowNonFinite": False,
    "inputShapes": None,
    "paddingValue": 0.0,
    "config": {},
    "precision": "32",
    "compileModel": False,
    "strategy": "ddp",
    "shardModules": None,
}


class ModelParams(HasFeaturesCol, HasLabelCol, HasPredictionCol, HasRawPredictionCol, HasProbabilityCol):
    """Params of the columns a model reads and writes. Params that may be None use
    converters that accept None, so saved models load back.

    Output columns follow Spark ML's classifier convention: an output column whose Param
    is set to an empty string is omitted.
    """

    featuresCol: Param = Param(
        Params._dummy(), "featuresCol", "Vector, array<numeric> or numeric column; None to use featureCols",
        typeConverter=_to_optional_string,
    )
    featureCols: Param = Param(
        Params._dummy(), "featureCols",
        "numeric columns to use as features, instead of featuresCol",
        typeConverter=_to_optional_string_list,
    )
    inputCols: Param = Param(
        Params._dummy(), "inputCols",
        "columns given to the model as separate typed inputs, model(*inputs), in this order (instead of "
        "featuresCol/featureCols): integers as int64 (ids stay exact), floats as float32, booleans, binary as uint8, "
        "arrays and Vectors with their shapes, arrays of different lengths padded per batch",
        typeConverter=_to_optional_string_list,
    )
    weightCol: Param = Param(
        Params._dummy(), "weightCol",
        "numeric column of per-row sample weights: losses and metrics become weighted means; None = unweighted",
        typeConverter=_to_optional_string,
    )
    rawPredictionCol: Param = Param(
        Params._dummy(), "rawPredictionCol",
        "for classifiers (integer labels, several outputs): Vector column of the model's outputs "
        "(logits); '' = omit",
        typeConverter=_to_optional_string,
    )
    probabilityCol: Param = Param(
        Params._dummy(), "probabilityCol",
        "for classifiers (integer labels, several outputs): Vector column of the softmax of the "
        "outputs; '' = omit",
        typeConverter=_to_optional_string,
    )
    inferenceBatchSize: Param = Param(
        Params._dummy(), "inferenceBatchSize", "rows per forward pass in transform()",
        typeConverter=TypeConverters.toInt,
    )
    directRead: Param = Param(
        Params._dummy(), "directRead",
        "a plain Parquet table on a local or mounted filesystem is read by the tasks themselves with pyarrow, "
        "not through the JVM: in fit; in evaluate, and in transform where a join's broadcast decision stays as on "
        "the table, when pyarrow reads its columns exactly as Spark would pass them (False: always through Spark)",
        typeConverter=TypeConverters.toBoolean,
    )

    def getFeatureCols(self) -> list[str] | None:
        """Gets the value of featureCols or its default."""
        return self.getOrDefault(self.featureCols)

    def getInferenceBatchSize(self) -> int:
        """Gets the value of inferenceBatchSize or its default."""
        return self.getOrDefault(self.inferenceBatchSize)

    def setFeaturesCol(self: _P, value: str | None) -> _P:
        """Sets featuresCol (None: use featureCols)."""
        return self._set(featuresCol=value)

    def setFeatureCols(self: _P, value: list[str] | None) -> _P:
        """Sets featureCols."""
        return self._set(featureCols=value)

    def setLabelCol(self: _P, value: str) -> _P:
        """Sets labelCol."""
        return self._set(labelCol=value)

    def setPredictionCol(self: _P, value: str) -> _P:
        """Sets predictionCol."""
        return self._set(predictionCol=value)

    def setRawPredictionCol(self: _P, value: str) -> _P:
        """Sets rawPredictionCol ('' omits the column)."""
        return self._set(rawPredictionCol=value)

    def setProbabilityCol(self: _P, value: str) -> _P:
        """Sets probabilityCol ('' omits the column)."""
        return self._set(probabilityCol=value)

    def setInferenceBatchSize(self: _P, value: int) -> _P:
        """Sets inferenceBatchSize."""
        return self._set(inferenceBatchSize=value)

    def getInputCols(self) -> list[str] | None:
        """Gets the value of inputCols or its default."""
        return self.getOrDefault(self.inputCols)

    def setInputCols(self: _P, value: list[str] | None) -> _P:
        """Sets inputCols."""
        return self._set(inputCols=value)

    def getWeightCol(self) -> str | None:
        """Gets the value of weightCol or its default."""
        return self.getOrDefault(self.weightCol)

    def setWeightCol(self: _P, value: str | None) -> _P:
        """Sets weightCol."""
        return self._set(weightCol=value)

    def getDirectRead(self) -> bool:
        """Gets the value of directRead or its default."""
        return self.getOrDefault(self.directRead)

    def setDirectRead(self: _P, value: bool) -> _P:
        """Sets directRead."""
        return self._set(directRead=value)


class EstimatorParams(ModelParams, HasSeed, HasValidationIndicatorCol):
    """Params of TorchEstimator."""

    validationIndicatorCol: Param = Param(
        Params._dummy(), "validationIndicatorCol", "boolean column, True for validation rows; None = no validation",
        typeConverter=_to_optional_string,
    )
    batchSize: Param = Param(Params._dummy(), "batchSize", "rows per worker per step",
                             typeConverter=TypeConverters.toInt)
    maxEpochs: Param = Param(Params._dummy(), "maxEpochs", "the run never trains past this many epochs",
                             typeConverter=TypeConverters.toInt)
    numWorkers: Param = Param(Params._dummy(), "numWorkers", "barrier tasks, i.e. DDP ranks",
                              typeConverter=TypeConverters.toInt)
    minWorkers: Param = Param(Params._dummy(), "minWorkers",
                              "fewest ranks a launch may train with when fewer than numWorkers task slots are free "
                              "after slotWaitTimeout (the global batch stays batchSize * numWorkers); "
                              "None = numWorkers (no elasticity)",
                              typeConverter=_to_optional_int)
    checkpointDir: Param = Param(Params._dummy(), "checkpointDir",
                                 "fsspec URL for periodic checkpoints (None = only the driver's copy)",
                                 typeConverter=_to_optional_string)
    checkpointInterval: Param = Param(Params._dummy(), "checkpointInterval",
                                      "how often to write to checkpointDir, e.g. '1ep' or '500ba'",
                                      typeConverter=TypeConverters.toString)
    maxRetries: Param = Param(Params._dummy(), "maxRetries",
                              "relaunches of a failed job from the newest checkpoint",
                              typeConverter=TypeConverters.toInt)
    useGpu: Param = Param(Params._dummy(), "useGpu", "True/False, or None to use GPUs when tasks have them",
                          typeConverter=_to_optional_bool)
    timeout: Param = Param(Params._dummy(), "timeout",
                           "seconds before a rendezvous or collective that does not complete fails the fit",
                           typeConverter=TypeConverters.toFloat)
    slotWaitTimeout: Param = Param(Params._dummy(), "slotWaitTimeout",
                                   "seconds to wait for executors to offer numWorkers task slots",
                                   typeConverter=TypeConverters.toFloat)
    memoryBudgetMB: Param = Param(Params._dummy(), "memoryBudgetMB",
                                  "MB of a partition's rows a rank keeps in RAM; beyond that they spill to "
                                  "local files read per batch (0: never spill)",
                                  typeConverter=TypeConverters.toFloat)
    keepIngestedMB: Param = Param(Params._dummy(), "keepIngestedMB",
                                  "MB of a DataFrame's rows each executor keeps on its local disk, as the ranks "
                                  "received them, so that later fits on the same unchanged DataFrame skip Spark's "
                                  "scan and shuffle; the least recently used are evicted past it (0: keep nothing)",
                                  typeConverter=TypeConverters.toFloat)
    inputShapes: Param = Param(Params._dummy(), "inputShapes",
                               "{column: [sizes]}: reshape each row of an inputCols column, e.g. {'image': [1, 8, 8]} "
                               "for 64 bytes; None = rows as they are",
                               typeConverter=_to_shapes)
    paddingValue: Param = Param(Params._dummy(), "paddingValue",
                                "what arrays shorter than the longest row of their batch are padded with",
                                typeConverter=TypeConverters.toFloat)
    allowNonFinite: Param = Param(Params._dummy(), "allowNonFinite",
                                  "train on when the loss is NaN or infinite (default False: the fit fails at "
                                  "that step and the run keeps its last good state)",
                                  typeConverter=TypeConverters.toBoolean)
    config: Param = Param(Params._dummy(), "config",
                          "plain dict handed to every creator (model, optimizer, scheduler); JSON values only",
                          typeConverter=to_config)
    showProgress: Param = Param(Params._dummy(), "showProgress",
                                "show a progress bar (a terminal or notebook), else progress and epoch lines on "
                                "stderr (through logging where it is set up)",
                                typeConverter=TypeConverters.toBoolean)
    precision: Param = Param(Params._dummy(), "precision",
                             "'32' (float32), 'bf16-mixed' (bfloat16 autocast) or '16-mixed' (float16 autocast and a "
                             "gradient scaler): the forward pass and loss of training, validation, evaluate and "
                             "transform; weights stay float32",
                             typeConverter=TypeConverters.toString)
    compileModel: Param = Param(Params._dummy(), "compileModel",
                                "compile each rank's model with torch.compile (one graph per batch shape)",
                                typeConverter=TypeConverters.toBoolean)
    strategy: Param = Param(Params._dummy(), "strategy",
                            "'ddp' (every rank holds the whole model) or 'fsdp' (FSDP2: each rank holds its shard of "
                            "the parameters and optimizer state; sharded checkpoints; needs checkpointDir)",
                            typeConverter=TypeConverters.toString)
    shardModules: Param = Param(Params._dummy(), "shardModules",
                                "with strategy='fsdp': class names of the submodules sharded on their own before the "
                                "root, e.g. ['TransformerBlock']; None = every direct child holding parameters",
                                typeConverter=_to_optional_string_list)

    def getConfig(self) -> dict[str, Any]:
        """A copy of config, the dict handed to every creator (mutating it changes nothing)."""
        return copy.deepcopy(self.getOrDefault(self.config))

    def setSeed(self: _P, value: int) -> _P:
        """Sets seed."""
        return self._set(seed=value)

    def setValidationIndicatorCol(self: _P, value: str | None) -> _P:
        """Sets validationIndicatorCol."""
        return self._set(validationIndicatorCol=value)

    def getBatchSize(self) -> int:
        """Gets the value of batchSize or its default."""
        return self.getOrDefault(self.batchSize)

    def setBatchSize(self: _P, value: int) -> _P:
        """Sets batchSize."""
        return self._set(batchSize=value)

    def getMaxEpochs(self) -> int:
        """Gets the value of maxEpochs or its default."""
        return self.getOrDefault(self.maxEpochs)

    def setMaxEpochs(self: _P, value: int) -> _P:
        """Sets maxEpochs."""
        return self._set(maxEpochs=value)

    def getNumWorkers(self) -> int:
        """Gets the value of numWorkers or its default."""
        return self.getOrDefault(self.numWorkers)

    def setNumWorkers(self: _P, value: int) -> _P:
        """Sets numWorkers."""
        return self._set(numWorkers=value)

    def getCheckpointDir(self) -> str | None:
        """Gets the value of checkpointDir or its default."""
        return self.getOrDefault(self.checkpointDir)

    def setCheckpointDir(self: _P, value: str | None) -> _P:
        """Sets checkpointDir."""
        return self._set(checkpointDir=value)

    def getCheckpointInterval(self) -> str:
        """Gets the value of checkpointInterval or its default."""
        return self.getOrDefault(self.checkpointInterval)

    def setCheckpointInterval(self: _P, value: str) -> _P:
        """Sets checkpointInterval."""
        return self._set(checkpointInterval=value)

    def getMaxRetries(self) -> int:
        """Gets the value of maxRetries or its default."""
        return self.getOrDefault(self.maxRetries)

    def setMaxRetries(self: _P, value: int) -> _P:
        """Sets maxRetries."""
        return self._set(maxRetries=value)

    def getUseGpu(self) -> bool | None:
        """Gets the value of useGpu or its default."""
        return self.getOrDefault(self.useGpu)

    def setUseGpu(self: _P, value: bool | None) -> _P:
        """Sets useGpu."""
        return self._set(useGpu=value)

    def getTimeout(self) -> float:
        """Gets the value of timeout or its default."""
        return self.getOrDefault(self.timeout)

    def setTimeout(self: _P, value: float) -> _P:
        """Sets timeout."""
        return self._set(timeout=value)

    def getSlotWaitTimeout(self) -> float:
        """Gets the value of slotWaitTimeout or its default."""
        return self.getOrDefault(self.slotWaitTimeout)

    def setSlotWaitTimeout(self: _P, value: float) -> _P:
        """Sets slotWaitTimeout."""
        return self._set(slotWaitTimeout=value)

    def getShowProgress(self) -> bool:
        """Gets the value of showProgress or its default."""
        return self.getOrDefault(self.showProgress)

    def setShowProgress(self: _P, value: bool) -> _P:
        """Sets showProgress."""
        return self._set(showProgress=value)

    def getMemoryBudgetMB(self) -> float:
        """Gets the value of memoryBudgetMB or its default."""
        return self.getOrDefault(self.memoryBudgetMB)

    def setMemoryBudgetMB(self: _P, value: float) -> _P:
        """Sets memoryBudgetMB."""
        return self._set(memoryBudgetMB=value)

    def getKeepIngestedMB(self) -> float:
        """Gets the value of keepIngestedMB or its default."""
        return self.getOrDefault(self.keepIngestedMB)

    def setKeepIngestedMB(self: _P, value: float) -> _P:
        """Sets keepIngestedMB."""
        return self._set(keepIngestedMB=value)

    def getAllowNonFinite(self) -> bool:
        """Gets the value of allowNonFinite or its default."""
        return self.getOrDefault(self.allowNonFinite)

    def setAllowNonFinite(self: _P, value: bool) -> _P:
        """Sets allowNonFinite."""
        return self._set(allowNonFinite=value)

    def getInputShapes(self) -> dict[str, list[int]] | None:
        """Gets the value of inputShapes or its default."""
        return self.getOrDefault(self.inputShapes)

    def setInputShapes(self: _P, value: dict[str, list[int]] | None) -> _P:
        """Sets inputShapes."""
        return self._set(inputShapes=value)

    def getPaddingValue(self) -> float:
        """Gets the value of paddingValue or its default."""
        return self.getOrDefault(self.paddingValue)

    def setPaddingValue(self: _P, value: float) -> _P:
        """Sets paddingValue."""
        return self._set(paddingValue=value)

    def getMinWorkers(self) -> int | None:
        """Gets the value of minWorkers or its default."""
        return self.getOrDefault(self.minWorkers)

    def setMinWorkers(self: _P, value: int | None) -> _P:
        """Sets minWorkers."""
        return self._set(minWorkers=value)

    def getPrecision(self) -> str:
        """Gets the value of precision or its default."""
        return self.getOrDefault(self.precision)

    def setPrecision(self: _P, value: str) -> _P:
        """Sets precision."""
        return self._set(precision=value)

    def getCompileModel(self) -> bool:
        """Gets the value of compileModel or its default."""
        return self.getOrDefault(self.compileModel)

    def setCompileModel(self: _P, value: bool) -> _P:
        """Sets compileModel."""
        return self._set(compileModel=value)

    def getStrategy(self) -> str:
        """Gets the value of strategy or its default."""
        return self.getOrDefault(self.strategy)

    def setStrategy(self: _P, value: str) -> _P:
        """Sets strategy."""
        return self._set(strategy=value)

    def getShardModules(self) -> list[str] | None:
        """Gets the value of shardModules or its default."""
        return self.getOrDefault(self.shardModules)

    def setShardModules(self: _P, value: list[str] | None) -> _P:
        """Sets shardModules."""
        return self._set(shardModules=value)


def param_map_name(param_map: dict) -> str:
    """A param map as a short readable name, e.g. ``"batchSize=32, config={'lr': 0.01}"``
    (what loggers call a fit with a param map)."""
    return ", ".join(f"{getattr(param, 'name', param)}={value!r}" for param, value in param_map.items()) or "defaults"


def carry_params(source: Params, target: Params) -> None:
    """Gives ``target`` (a fitted model) every Param of ``source`` (its estimator) that it
    lacks, with the value it has there: set where it is set, a default where it is a
    default. So a model says what it was trained with, and saves and loads it."""
    for param in source.params:
        if not target.hasParam(param.name):
            _declare(target, param.name, param.doc, param.typeConverter)
        if not source.isDefined(param):
            continue
        if source.isSet(param):
            target._set(**{param.name: source.getOrDefault(param)})
        elif not target.isSet(param.name):
            target._setDefault(**{param.name: source.getOrDefault(param)})


def declare_params(instance: Params, names: Iterable[str]) -> None:
    """Declares on ``instance`` the Params ``names`` that its class lacks (the estimator
    Params a saved model was trained with, see :func:`carry_params`), as the estimator
    declares them."""
    for name in names:
        if not instance.hasParam(name):
            declared = getattr(EstimatorParams, name, None)
            if isinstance(declared, Param):
                _declare(instance, name, declared.doc, declared.typeConverter)
            else:  # a Param of the estimator that this version does not know: kept as saved
                _declare(instance, name, "a Param of the estimator the model was trained with",
                         TypeConverters.identity)


def _declare(instance: Params, name: str, doc: str, converter: Callable[[Any], Any]) -> None:
    setattr(instance, name, Param(instance, name, doc, typeConverter=converter))
    instance._params = None  # pyspark caches the Param list
