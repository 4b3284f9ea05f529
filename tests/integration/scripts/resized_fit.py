"""Run by test_between_fits.py on local[3]: a run of numWorkers=2 stopped mid-epoch and
continued by later fits on one rank, then on three (the global batch kept at 12 rows), and
the same run undisturbed; a hook keeps every global step's row ids, gathered across ranks."""

import json
import os
import sys

import numpy as np
import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import TorchEstimator  # noqa: E402
from tests.helpers import StepRows, linear_model, sgd  # noqa: E402

ROWS = 600


def estimator(**params) -> TorchEstimator:
    return TorchEstimator(**{**dict(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), labelCol="id",
                                    maxEpochs=2, seed=5, showProgress=False, hooks=[StepRows()]), **params})


spark = SparkSession.builder.master("local[3]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
x = np.random.default_rng(2).normal(size=(ROWS, 8))
df = spark.createDataFrame([(row.tolist(), float(i)) for i, row in enumerate(x)], ["features", "id"]).cache()
df.count()

whole = estimator(numWorkers=2, batchSize=6)
whole.fit(df)
resized = estimator(numWorkers=2, batchSize=6)
resized.fit(df, duration="17ba")                    # mid-epoch 1 on two ranks
resized.setNumWorkers(1).setBatchSize(12)
resized.fit(df, duration="50ba")                    # through the end of epoch 1 into epoch 2 on one
resized.setNumWorkers(3).setBatchSize(4)
resized.fit(df)                                     # the rest on three
result = {name: {"steps": est.checkpoint.hook_states["StepRows"]["steps"], "global_step": est.progress.global_step,
                 "samples": est.progress.samples, "history": est.history}
          for name, est in (("whole", whole), ("resized", resized))}
print("RESULT " + json.dumps(result))
spark.stop()
