"""Train PyTorch models on Spark DataFrames: a pyspark.ml Estimator over barrier-mode DDP."""

from spark_torch_est.builtin_hooks import (EarlyStopping, GradientClipping, SchedulerPerIteration,
                                           SetHyperparameters, Throughput)
from spark_torch_est.checkpoint import Checkpoint
from spark_torch_est.duration import Duration
from spark_torch_est.estimator import TorchEstimator
from spark_torch_est.hooks import Control, Hook
from spark_torch_est.model import TorchModel
from spark_torch_est.progress import Progress

__all__ = [
    "TorchEstimator", "TorchModel", "Hook", "Control", "Checkpoint", "Duration", "Progress",
    "EarlyStopping", "GradientClipping", "SchedulerPerIteration", "Throughput", "SetHyperparameters",
]
__version__ = "0.1.0"
