"""[driver] Spark ML Param declarations and their defaults (the one home of every default)."""

from __future__ import annotations

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

__all__ = ["ModelParams", "EstimatorParams", "ESTIMATOR_DEFAULTS", "MODEL_DEFAULTS"]


def _to_optional_bool(value: object) -> bool | None:
    return None if value is None else TypeConverters.toBoolean(value)


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
    "seed": 0,
    "checkpointDir": None,
    "checkpointInterval": "1ep",
    "maxRetries": 1,
    "useGpu": None,
    "timeout": 600.0,
    "slotWaitTimeout": 60.0,
    "showProgress": True,
    "memoryBudgetMB": 4096.0,
    "allowNonFinite": False,
    "inputShapes": None,
    "paddingValue": 0.0,
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

    def setFeaturesCol(self, value: str | None):
        """Sets featuresCol (None: use featureCols)."""
        return self._set(featuresCol=value)

    def setFeatureCols(self, value: list[str] | None):
        """Sets featureCols."""
        return self._set(featureCols=value)

    def setLabelCol(self, value: str):
        """Sets labelCol."""
        return self._set(labelCol=value)

    def setPredictionCol(self, value: str):
        """Sets predictionCol."""
        return self._set(predictionCol=value)

    def setRawPredictionCol(self, value: str):
        """Sets rawPredictionCol ('' omits the column)."""
        return self._set(rawPredictionCol=value)

    def setProbabilityCol(self, value: str):
        """Sets probabilityCol ('' omits the column)."""
        return self._set(probabilityCol=value)

    def setInferenceBatchSize(self, value: int):
        """Sets inferenceBatchSize."""
        return self._set(inferenceBatchSize=value)


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
    showProgress: Param = Param(Params._dummy(), "showProgress",
                                "show a progress bar (a terminal) or log lines on the driver",
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

    def setSeed(self, value: int):
        """Sets seed."""
        return self._set(seed=value)

    def setValidationIndicatorCol(self, value: str | None):
        """Sets validationIndicatorCol."""
        return self._set(validationIndicatorCol=value)


def _accessors(cls: type, name: str) -> None:
    cap, doc = name[0].upper() + name[1:], getattr(cls, name).doc
    setattr(cls, f"get{cap}", lambda self: self.getOrDefault(getattr(self, name)))
    setattr(cls, f"set{cap}", lambda self, value: self._set(**{name: value}))
    getattr(cls, f"get{cap}").__doc__ = f"Gets the value of {name} or its default ({doc})."
    getattr(cls, f"set{cap}").__doc__ = f"Sets {name} ({doc})."


for _name in ("inputCols", "weightCol", "directRead"):
    _accessors(ModelParams, _name)
for _name in ("batchSize", "maxEpochs", "numWorkers", "checkpointDir", "checkpointInterval",
              "maxRetries", "useGpu", "timeout", "slotWaitTimeout", "showProgress", "memoryBudgetMB",
              "allowNonFinite", "inputShapes", "paddingValue", "precision", "compileModel", "strategy",
              "shardModules"):
    _accessors(EstimatorParams, _name)
