"""[both] Train PyTorch models on Spark DataFrames: a pyspark.ml Estimator over barrier-mode DDP.

Names are imported on first use, so an executor that only runs the training loop never
pays for importing the driver side (``pyspark.ml`` alone is a slow import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "TorchEstimator", "TorchModel", "Hook", "Control", "Checkpoint", "Duration", "Progress",
    "EarlyStopping", "GradientClipping", "SchedulerPerIteration", "Throughput", "SetHyperparameters",
    "Logger", "MLflowLogger", "TensorBoardLogger", "CSVLogger",
]
__version__ = "0.1.0"

_HOMES = {
    "TorchEstimator": "estimator", "TorchModel": "model", "Hook": "train.hooks", "Control": "train.hooks",
    "Checkpoint": "checkpoints.checkpoint", "Duration": "core.duration", "Progress": "core.progress",
    "EarlyStopping": "train.builtin_hooks", "GradientClipping": "train.builtin_hooks",
    "SchedulerPerIteration": "train.builtin_hooks", "Throughput": "train.builtin_hooks",
    "SetHyperparameters": "train.builtin_hooks",
    "Logger": "loggers", "MLflowLogger": "loggers", "TensorBoardLogger": "loggers", "CSVLogger": "loggers",
}

if TYPE_CHECKING:
    from spark_torch_est.checkpoints.checkpoint import Checkpoint
    from spark_torch_est.core.duration import Duration
    from spark_torch_est.core.progress import Progress
    from spark_torch_est.estimator import TorchEstimator
    from spark_torch_est.loggers import CSVLogger, Logger, MLflowLogger, TensorBoardLogger
    from spark_torch_est.model import TorchModel
    from spark_torch_est.train.builtin_hooks import (
        EarlyStopping,
        GradientClipping,
        SchedulerPerIteration,
        SetHyperparameters,
        Throughput,
    )
    from spark_torch_est.train.hooks import Control, Hook


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'spark_torch_est' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"spark_torch_est.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
