"""[driver] TrainingParams: what is trained, on which rows, and how.

Params of TorchEstimator and TorchModel, their defaults and typed accessors. GENERATED from the table in
spark_torch_est/params/table.py by ``make params`` (``python -m spark_torch_est.params.codegen``):
do not edit by hand; tests/unit/params/test_table.py fails while this file is stale. See docs/params.md.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

from pyspark.ml.param import Param, Params, TypeConverters

from spark_torch_est.params.table import (
    to_config,
    to_optional_string,
    to_optional_string_list,
    to_shapes,
    to_trainer_args,
)

__all__ = ["TrainingParams"]

_P = TypeVar("_P", bound=Params)


class TrainingParams(Params):
    """Params of TorchEstimator and TorchModel: what is trained, on which rows, and how."""

    config: Param = Param(
        Params._dummy(), "config",
        "plain dict handed to every creator (model, optimizer, scheduler); JSON values only",
        typeConverter=to_config,
    )
    batchSize: Param = Param(
        Params._dummy(), "batchSize",
        "rows per worker per step",
        typeConverter=TypeConverters.toInt,
    )
    maxEpochs: Param = Param(
        Params._dummy(), "maxEpochs",
        "the run never trains past this many epochs",
        typeConverter=TypeConverters.toInt,
    )
    seed: Param = Param(
        Params._dummy(), "seed",
        "seed of initialization, shuffles and RNG streams",
        typeConverter=TypeConverters.toInt,
    )
    validationIndicatorCol: Param = Param(
        Params._dummy(), "validationIndicatorCol",
        "boolean column, True for validation rows; None = no validation",
        typeConverter=to_optional_string,
    )
    inputShapes: Param = Param(
        Params._dummy(), "inputShapes",
        "{column: [sizes]}: reshape each row of an inputCols column, e.g. {'image': [1, 8, 8]} for 64 bytes; None = "
        "rows as they are",
        typeConverter=to_shapes,
    )
    paddingValue: Param = Param(
        Params._dummy(), "paddingValue",
        "what arrays shorter than the longest row of their batch are padded with",
        typeConverter=TypeConverters.toFloat,
    )
    allowNonFinite: Param = Param(
        Params._dummy(), "allowNonFinite",
        "train on when the loss is NaN or infinite (default False: the fit fails at that step and the run keeps its "
        "last good state)",
        typeConverter=TypeConverters.toBoolean,
    )
    precision: Param = Param(
        Params._dummy(), "precision",
        "'32' (float32), 'bf16-mixed' (bfloat16 autocast) or '16-mixed' (float16 autocast and a gradient scaler): the "
        "forward pass and loss of training, validation, evaluate and transform; weights stay float32",
        typeConverter=TypeConverters.toString,
    )
    compileModel: Param = Param(
        Params._dummy(), "compileModel",
        "compile each rank's model with torch.compile (one graph per batch shape)",
        typeConverter=TypeConverters.toBoolean,
    )
    strategy: Param = Param(
        Params._dummy(), "strategy",
        "'ddp' (every rank holds the whole model) or 'fsdp' (FSDP2: each rank holds its shard of the parameters and "
        "optimizer state; sharded checkpoints; needs checkpointDir)",
        typeConverter=TypeConverters.toString,
    )
    shardModules: Param = Param(
        Params._dummy(), "shardModules",
        "with strategy='fsdp': class names of the submodules sharded on their own before the root, e.g. "
        "['TransformerBlock']; None = every direct child holding parameters",
        typeConverter=to_optional_string_list,
    )
    trainerArgs: Param = Param(
        Params._dummy(), "trainerArgs",
        "with a LightningModule as the model: more arguments of Lightning's Trainer, e.g. {'gradient_clip_val': 1.0}; "
        "JSON values only; not those the estimator sets (devices, num_nodes, strategy, max_epochs, ...)",
        typeConverter=to_trainer_args,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            config={},
            batchSize=64,
            maxEpochs=10,
            seed=0,
            validationIndicatorCol=None,
            inputShapes=None,
            paddingValue=0.0,
            allowNonFinite=False,
            precision="32",
            compileModel=False,
            strategy="ddp",
            shardModules=None,
            trainerArgs={},
        )

    def getConfig(self) -> dict[str, Any]:
        """Gets a copy of the value of config or of its default, ``{}`` (changing it changes nothing)."""
        return copy.deepcopy(self.getOrDefault(self.config))

    def setConfig(self: _P, value: dict[str, Any]) -> _P:
        """Sets the value of config."""
        return self._set(config=value)

    def getBatchSize(self) -> int:
        """Gets the value of batchSize or its default, ``64``."""
        return self.getOrDefault(self.batchSize)

    def setBatchSize(self: _P, value: int) -> _P:
        """Sets the value of batchSize."""
        return self._set(batchSize=value)

    def getMaxEpochs(self) -> int:
        """Gets the value of maxEpochs or its default, ``10``."""
        return self.getOrDefault(self.maxEpochs)

    def setMaxEpochs(self: _P, value: int) -> _P:
        """Sets the value of maxEpochs."""
        return self._set(maxEpochs=value)

    def getSeed(self) -> int:
        """Gets the value of seed or its default, ``0``."""
        return self.getOrDefault(self.seed)

    def setSeed(self: _P, value: int) -> _P:
        """Sets the value of seed."""
        return self._set(seed=value)

    def getValidationIndicatorCol(self) -> str | None:
        """Gets the value of validationIndicatorCol or its default, ``None``."""
        return self.getOrDefault(self.validationIndicatorCol)

    def setValidationIndicatorCol(self: _P, value: str | None) -> _P:
        """Sets the value of validationIndicatorCol."""
        return self._set(validationIndicatorCol=value)

    def getInputShapes(self) -> dict[str, list[int]] | None:
        """Gets the value of inputShapes or its default, ``None``."""
        return self.getOrDefault(self.inputShapes)

    def setInputShapes(self: _P, value: dict[str, list[int]] | None) -> _P:
        """Sets the value of inputShapes."""
        return self._set(inputShapes=value)

    def getPaddingValue(self) -> float:
        """Gets the value of paddingValue or its default, ``0.0``."""
        return self.getOrDefault(self.paddingValue)

    def setPaddingValue(self: _P, value: float) -> _P:
        """Sets the value of paddingValue."""
        return self._set(paddingValue=value)

    def getAllowNonFinite(self) -> bool:
        """Gets the value of allowNonFinite or its default, ``False``."""
        return self.getOrDefault(self.allowNonFinite)

    def setAllowNonFinite(self: _P, value: bool) -> _P:
        """Sets the value of allowNonFinite."""
        return self._set(allowNonFinite=value)

    def getPrecision(self) -> str:
        """Gets the value of precision or its default, ``"32"``."""
        return self.getOrDefault(self.precision)

    def setPrecision(self: _P, value: str) -> _P:
        """Sets the value of precision."""
        return self._set(precision=value)

    def getCompileModel(self) -> bool:
        """Gets the value of compileModel or its default, ``False``."""
        return self.getOrDefault(self.compileModel)

    def setCompileModel(self: _P, value: bool) -> _P:
        """Sets the value of compileModel."""
        return self._set(compileModel=value)

    def getStrategy(self) -> str:
        """Gets the value of strategy or its default, ``"ddp"``."""
        return self.getOrDefault(self.strategy)

    def setStrategy(self: _P, value: str) -> _P:
        """Sets the value of strategy."""
        return self._set(strategy=value)

    def getShardModules(self) -> list[str] | None:
        """Gets the value of shardModules or its default, ``None``."""
        return self.getOrDefault(self.shardModules)

    def setShardModules(self: _P, value: list[str] | None) -> _P:
        """Sets the value of shardModules."""
        return self._set(shardModules=value)

    def getTrainerArgs(self) -> dict[str, Any]:
        """Gets a copy of the value of trainerArgs or of its default, ``{}`` (changing it changes nothing)."""
        return copy.deepcopy(self.getOrDefault(self.trainerArgs))

    def setTrainerArgs(self: _P, value: dict[str, Any]) -> _P:
        """Sets the value of trainerArgs."""
        return self._set(trainerArgs=value)
