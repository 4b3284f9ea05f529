"""Run by test_interrupt.py: a fit interrupted by SIGINT, then a fit that resumes."""

import os
import sys

import numpy as np
import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import Hook, TorchEstimator  # noqa: E402
from tests.helpers import linear_model, listening_ports, sgd  # noqa: E402

MARKER = sys.argv[1]


class Marker(Hook):
    """Creates MARKER once the long second fit is well under way."""

    def after_train_iter(self, rank, global_step, state):
        if rank == 0 and state.epoch >= 1 and state.batch_in_epoch == 3:
            open(MARKER, "w").close()


spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
rng = np.random.default_rng(0)
x = rng.normal(size=(2000, 8))
df = spark.createDataFrame([(r.tolist(), float(r.sum())) for r in x], ["features", "label"])
est = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), batchSize=16,
                     maxEpochs=100000, numWorkers=2, showProgress=False, hooks=[Marker()])
est.fit(df, duration="1ep")
before = est.progress
ports = listening_ports(os.getpid())
print("FIRST", before.global_step, flush=True)
try:
    est.fit(df)
    print("NOT INTERRUPTED", flush=True)
except KeyboardInterrupt:
    print("INTERRUPTED", est.progress == before, listening_ports(os.getpid()) <= ports, flush=True)
est.fit(df, duration="1ep")
print("RESUMED", est.progress.epoch, flush=True)
spark.stop()
