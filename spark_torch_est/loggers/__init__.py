"""[driver] Loggers: experiment tracking on the driver, fed by what the ranks already send.

One module per concept:

- :mod:`~spark_torch_est.loggers.base`: the :class:`Logger` base class, its events and
  their arguments. A new logger subclasses it in a module of its own, which imports the
  base and nothing else of this package.
- :mod:`~spark_torch_est.loggers.csv_logger`, :mod:`~spark_torch_est.loggers.tensorboard_logger`,
  :mod:`~spark_torch_est.loggers.mlflow_logger`: the built-in loggers.
- :mod:`~spark_torch_est.loggers.dispatch`: hands one fit's events to its loggers, each
  within a deadline.
- :mod:`~spark_torch_est.loggers.view`: the progress bar and log lines the driver shows.

The dispatcher and the view read the same stream: the ranks' messages
(:class:`~spark_torch_est.cluster.messages.RankMessage`), decoded once by the channel.
"""

from __future__ import annotations

from spark_torch_est.loggers.base import EVENT_ARGUMENTS, Logger
from spark_torch_est.loggers.csv_logger import CSVLogger
from spark_torch_est.loggers.mlflow_logger import MLflowLogger
from spark_torch_est.loggers.tensorboard_logger import TensorBoardLogger

__all__ = ["Logger", "EVENT_ARGUMENTS", "CSVLogger", "MLflowLogger", "TensorBoardLogger"]
