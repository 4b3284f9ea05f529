"""[driver] ColumnParams: the columns a model reads and writes, and how transform reads them.

Params of TorchEstimator and TorchModel, their defaults and typed accessors. GENERATED from the table in
spark_torch_est/params/table.py by ``make params`` (``python -m spark_torch_est.params.codegen``):
do not edit by hand; tests/unit/params/test_table.py fails while this file is stale. See docs/params.md.
"""

from __future__ import annotations

from typing import TypeVar

from pyspark.ml.param import Param, Params, TypeConverters

from spark_torch_est.params.table import to_optional_string, to_optional_string_list

__all__ = ["ColumnParams"]

_P = TypeVar("_P", bound=Params)


class ColumnParams(Params):
    """Params of TorchEstimator and TorchModel: the columns a model reads and writes, and how transform reads them."""

    featuresCol: Param = Param(
        Params._dummy(), "featuresCol",
        "Vector, array<numeric> or numeric column; None to use featureCols",
        typeConverter=to_optional_string,
    )
    featureCols: Param = Param(
        Params._dummy(), "featureCols",
        "numeric columns to use as features, instead of featuresCol",
        typeConverter=to_optional_string_list,
    )
    inputCols: Param = Param(
        Params._dummy(), "inputCols",
        "columns given to the model as separate typed inputs, model(*inputs), in this order (instead of "
        "featuresCol/featureCols): integers as int64 (ids stay exact), floats as float32, booleans, binary as uint8, "
        "arrays and Vectors with their shapes, arrays of different lengths padded per batch",
        typeConverter=to_optional_string_list,
    )
    labelCol: Param = Param(
        Params._dummy(), "labelCol",
        "label column; integer labels with several outputs are class indices",
        typeConverter=TypeConverters.toString,
    )
    weightCol: Param = Param(
        Params._dummy(), "weightCol",
        "numeric column of per-row sample weights: losses and metrics become weighted means; None = unweighted",
        typeConverter=to_optional_string,
    )
    predictionCol: Param = Param(
        Params._dummy(), "predictionCol",
        "output column of the model; for classifiers (integer labels, several outputs) the class index",
        typeConverter=TypeConverters.toString,
    )
    rawPredictionCol: Param = Param(
        Params._dummy(), "rawPredictionCol",
        "for classifiers (integer labels, several outputs): Vector column of the model's outputs (logits); '' = omit",
        typeConverter=to_optional_string,
    )
    probabilityCol: Param = Param(
        Params._dummy(), "probabilityCol",
        "for classifiers (integer labels, several outputs): Vector column of the softmax of the outputs; '' = omit",
        typeConverter=to_optional_string,
    )
    inferenceBatchSize: Param = Param(
        Params._dummy(), "inferenceBatchSize",
        "rows per forward pass in transform()",
        typeConverter=TypeConverters.toInt,
    )
    directRead: Param = Param(
        Params._dummy(), "directRead",
        "a plain Parquet table on a local or mounted filesystem is read by the tasks themselves with pyarrow, not "
        "through the JVM: in fit; in evaluate, and in transform where a join's broadcast decision stays as on the "
        "table, when pyarrow reads its columns exactly as Spark would pass them (False: always through Spark)",
        typeConverter=TypeConverters.toBoolean,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            featuresCol="features",
            featureCols=None,
            inputCols=None,
            labelCol="label",
            weightCol=None,
            predictionCol="prediction",
            rawPredictionCol="rawPrediction",
            probabilityCol="probability",
            inferenceBatchSize=4096,
            directRead=True,
        )

    def getFeaturesCol(self) -> str | None:
        """Gets the value of featuresCol or its default, ``"features"``."""
        return self.getOrDefault(self.featuresCol)

    def setFeaturesCol(self: _P, value: str | None) -> _P:
        """Sets the value of featuresCol."""
        return self._set(featuresCol=value)

    def getFeatureCols(self) -> list[str] | None:
        """Gets the value of featureCols or its default, ``None``."""
        return self.getOrDefault(self.featureCols)

    def setFeatureCols(self: _P, value: list[str] | None) -> _P:
        """Sets the value of featureCols."""
        return self._set(featureCols=value)

    def getInputCols(self) -> list[str] | None:
        """Gets the value of inputCols or its default, ``None``."""
        return self.getOrDefault(self.inputCols)

    def setInputCols(self: _P, value: list[str] | None) -> _P:
        """Sets the value of inputCols."""
        return self._set(inputCols=value)

    def getLabelCol(self) -> str:
        """Gets the value of labelCol or its default, ``"label"``."""
        return self.getOrDefault(self.labelCol)

    def setLabelCol(self: _P, value: str) -> _P:
        """Sets the value of labelCol."""
        return self._set(labelCol=value)

    def getWeightCol(self) -> str | None:
        """Gets the value of weightCol or its default, ``None``."""
        return self.getOrDefault(self.weightCol)

    def setWeightCol(self: _P, value: str | None) -> _P:
        """Sets the value of weightCol."""
        return self._set(weightCol=value)

    def getPredictionCol(self) -> str:
        """Gets the value of predictionCol or its default, ``"prediction"``."""
        return self.getOrDefault(self.predictionCol)

    def setPredictionCol(self: _P, value: str) -> _P:
        """Sets the value of predictionCol."""
        return self._set(predictionCol=value)

    def getRawPredictionCol(self) -> str:
        """Gets the value of rawPredictionCol or its default, ``"rawPrediction"``."""
        return self.getOrDefault(self.rawPredictionCol)

    def setRawPredictionCol(self: _P, value: str) -> _P:
        """Sets the value of rawPredictionCol."""
        return self._set(rawPredictionCol=value)

    def getProbabilityCol(self) -> str:
        """Gets the value of probabilityCol or its default, ``"probability"``."""
        return self.getOrDefault(self.probabilityCol)

    def setProbabilityCol(self: _P, value: str) -> _P:
        """Sets the value of probabilityCol."""
        return self._set(probabilityCol=value)

    def getInferenceBatchSize(self) -> int:
        """Gets the value of inferenceBatchSize or its default, ``4096``."""
        return self.getOrDefault(self.inferenceBatchSize)

    def setInferenceBatchSize(self: _P, value: int) -> _P:
        """Sets the value of inferenceBatchSize."""
        return self._set(inferenceBatchSize=value)

    def getDirectRead(self) -> bool:
        """Gets the value of directRead or its default, ``True``."""
        return self.getOrDefault(self.directRead)

    def setDirectRead(self: _P, value: bool) -> _P:
        """Sets the value of directRead."""
        return self._set(directRead=value)
