"""Run by test_progress_modes.py through spark-submit, and as a notebook's cell: a fit in a
driver that imports IPython and ipykernel (as pyspark does where Jupyter is installed), with
progress lines every second instead of every 10 s, and steps that take a while."""

import time

import ipykernel  # noqa: F401
import IPython  # noqa: F401 - what pyspark imports to capture call sites
import torch
from pyspark.sql import SparkSession

from spark_torch_est import Hook, TorchEstimator
from spark_torch_est.loggers import view

view.LINE_EVERY_S = 1.0


class Slow(Hook):
    def after_train_iter(self):
        time.sleep(0.05)  # a step that takes a while, as a real model's does


spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
df = spark.createDataFrame([([float(i % 7), 1.0], float(i % 7)) for i in range(64)], ["features", "label"])
est = TorchEstimator(model=torch.nn.Linear(2, 1), optimizer=lambda m, c: torch.optim.SGD(m.parameters(), lr=1e-3),
                     loss=torch.nn.MSELoss(), maxEpochs=12, numWorkers=2, batchSize=8, hooks=[Slow()])
est.fit(df)
print("FITTED", est.progress.global_step)
