"""Run by test_driver_output.py: fits in a plain script that sets up no logging, its
stderr not a terminal (as under spark-submit).

``show``: a fit with progress, then ``--- quiet ---`` and a fit with showProgress=False.
``fail``: a fit whose hook raises on every rank; the error is left uncaught.
``compiled``: a fit with compileModel=True on two ranks.
"""

import os
import sys

import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import Hook, TorchEstimator  # noqa: E402


class Boom(Hook):
    def after_train_iter(self, batch_idx):
        if batch_idx == 1:
            raise ValueError("boom in the hook")


def estimator(**params) -> TorchEstimator:
    return TorchEstimator(model=torch.nn.Linear(2, 1), optimizer=lambda m, c: torch.optim.SGD(m.parameters(), lr=1e-3),
                          loss=torch.nn.MSELoss(), maxEpochs=2, numWorkers=2, batchSize=8, **params)


spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
df = spark.createDataFrame([([float(i % 7), 1.0], float(i % 7)) for i in range(64)], ["features", "label"])
try:
    if sys.argv[1] == "show":
        estimator().fit(df)
        sys.stderr.write("--- quiet ---\n")
        estimator(showProgress=False).fit(df)
    elif sys.argv[1] == "compiled":
        estimator(compileModel=True, showProgress=False).fit(df)
    else:
        estimator(hooks=[Boom()]).fit(df)
finally:
    spark.stop()
