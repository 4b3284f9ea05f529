"""[driver] HalvingParams: what successive halving tunes and how its rungs keep and train configurations.

Params of SuccessiveHalving, their defaults and typed accessors. GENERATED from the table in
spark_torch_est/params/table.py by ``make params`` (``python -m spark_torch_est.params.codegen``):
do not edit by hand; tests/unit/params/test_table.py fails while this file is stale. See docs/params.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from pyspark.ml.param import Param, Params, TypeConverters

if TYPE_CHECKING:
    from pyspark.ml.evaluation import Evaluator

    from spark_torch_est.estimator import TorchEstimator

__all__ = ["HalvingParams"]

_P = TypeVar("_P", bound=Params)


class HalvingParams(Params):
    """Params of SuccessiveHalving: what successive halving tunes and how its rungs keep and train configurations."""

    estimator: Param = Param(
        Params._dummy(), "estimator",
        "the TorchEstimator to tune",
        typeConverter=TypeConverters.identity,
    )
    estimatorParamMaps: Param = Param(
        Params._dummy(), "estimatorParamMaps",
        "the param maps to choose from",
        typeConverter=TypeConverters.identity,
    )
    evaluator: Param = Param(
        Params._dummy(), "evaluator",
        "scores each configuration on the validation rows (its isLargerBetter decides)",
        typeConverter=TypeConverters.identity,
    )
    eta: Param = Param(
        Params._dummy(), "eta",
        "each rung keeps the best ceil(n / eta) and trains them eta times as many epochs (at least 2)",
        typeConverter=TypeConverters.toInt,
    )
    minDuration: Param = Param(
        Params._dummy(), "minDuration",
        "epochs every configuration trains in rung 0, e.g. '1ep'",
        typeConverter=TypeConverters.toString,
    )
    trainRatio: Param = Param(
        Params._dummy(), "trainRatio",
        "fraction of the rows trained on when the estimator has no validationIndicatorCol (the rest validate)",
        typeConverter=TypeConverters.toFloat,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            eta=2,
            minDuration="1ep",
            trainRatio=0.75,
        )

    def getEstimator(self) -> TorchEstimator:
        """Gets the value of estimator (it has no default)."""
        return self.getOrDefault(self.estimator)

    def setEstimator(self: _P, value: TorchEstimator) -> _P:
        """Sets the value of estimator."""
        return self._set(estimator=value)

    def getEstimatorParamMaps(self) -> list[dict]:
        """Gets the value of estimatorParamMaps (it has no default)."""
        return self.getOrDefault(self.estimatorParamMaps)

    def setEstimatorParamMaps(self: _P, value: list[dict]) -> _P:
        """Sets the value of estimatorParamMaps."""
        return self._set(estimatorParamMaps=value)

    def getEvaluator(self) -> Evaluator:
        """Gets the value of evaluator (it has no default)."""
        return self.getOrDefault(self.evaluator)

    def setEvaluator(self: _P, value: Evaluator) -> _P:
        """Sets the value of evaluator."""
        return self._set(evaluator=value)

    def getEta(self) -> int:
        """Gets the value of eta or its default, ``2``."""
        return self.getOrDefault(self.eta)

    def setEta(self: _P, value: int) -> _P:
        """Sets the value of eta."""
        return self._set(eta=value)

    def getMinDuration(self) -> str:
        """Gets the value of minDuration or its default, ``"1ep"``."""
        return self.getOrDefault(self.minDuration)

    def setMinDuration(self: _P, value: str) -> _P:
        """Sets the value of minDuration."""
        return self._set(minDuration=value)

    def getTrainRatio(self) -> float:
        """Gets the value of trainRatio or its default, ``0.75``."""
        return self.getOrDefault(self.trainRatio)

    def setTrainRatio(self: _P, value: float) -> _P:
        """Sets the value of trainRatio."""
        return self._set(trainRatio=value)
