"""[driver] The Params of TorchEstimator and TorchModel, put together from their generated families,
and how a fitted model carries its estimator's Params.

Every Param is one row of the table in :mod:`spark_torch_est.params.table`; its declaration,
default and typed ``getX``/``setX`` are generated from it into ``columns.py``,
``training.py`` and ``runtime.py`` of this folder (see docs/params.md). TorchModel declares
the estimator's Params in its class, as a pyspark.ml model shares its estimator's: only a
Param this version does not know (saved by a newer one, or of a user's estimator subclass)
is declared on an instance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

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

from spark_torch_est.params.columns import ColumnParams
from spark_torch_est.params.runtime import RuntimeParams
from spark_torch_est.params.training import TrainingParams

__all__ = ["ModelParams", "EstimatorParams", "carry_params", "declare_params", "param_map_name"]


class ModelParams(ColumnParams, HasFeaturesCol, HasLabelCol, HasPredictionCol, HasRawPredictionCol, HasProbabilityCol):
    """Params of the columns a model reads and writes (TorchModel's and TorchEstimator's).
    pyspark's shared mixins stay bases, so code that asks ``isinstance(stage, HasLabelCol)``
    still finds them; the generated Params, defaults and accessors come first.

    Output columns follow Spark ML's classifier convention: an output column whose Param
    is set to an empty string is omitted.
    """

    # pyspark's HasFeaturesCol types the getter as returning str; featuresCol is None where
    # featureCols or inputCols name the inputs. Overridden here once, so that the two bases'
    # disagreement does not reach every subclass (a user's too) under a type checker.
    def getFeaturesCol(self) -> str | None:  # type: ignore[override]
        """Gets the value of featuresCol or its default, ``"features"``."""
        return ColumnParams.getFeaturesCol(self)


class EstimatorParams(ModelParams, TrainingParams, RuntimeParams, HasSeed, HasValidationIndicatorCol):
    """Params of TorchEstimator, and of the TorchModel it fits (which holds the values it was
    trained with, see :func:`carry_params`)."""

    # As getFeaturesCol above: pyspark's HasValidationIndicatorCol says str, ours defaults to None.
    def getValidationIndicatorCol(self) -> str | None:  # type: ignore[override]
        """Gets the value of validationIndicatorCol or its default, ``None``."""
        return TrainingParams.getValidationIndicatorCol(self)


def param_map_name(param_map: dict) -> str:
    """A param map as a short readable name, e.g. ``"batchSize=32, config={'lr': 0.01}"``
    (what loggers call a fit with a param map)."""
    return ", ".join(f"{getattr(param, 'name', param)}={value!r}" for param, value in param_map.items()) or "defaults"


def carry_params(source: Params, target: Params) -> None:
    """Gives ``target`` (a fitted model) every Param of ``source`` (its estimator) with the
    value it has there: set where it is set, a default where it is a default (as pyspark's
    ``_copyValues``). So a model says what it was trained with, and saves and loads it. A
    Param its class lacks (one of an estimator subclass) is declared on ``target``."""
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
    """Declares on ``instance`` the Params ``names`` that its class lacks (a saved model's
    Params that this version does not declare, see :func:`carry_params`), as the estimator
    declares them where it does."""
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
