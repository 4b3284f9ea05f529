"""Run by test_interrupt_and_size.py: a checkpoint larger than spark.driver.maxResultSize.

With the driver's channel the checkpoint does not travel as a job result and the fit
succeeds; with ``rows`` the driver's services are off (as when executors cannot reach the
driver), the checkpoint comes back as result rows and the fit names the setting to raise.
"""

import os
import sys

import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import TorchEstimator  # noqa: E402
from spark_torch_est.cluster import launcher  # noqa: E402
from spark_torch_est.errors import TrainingFailedError  # noqa: E402

if sys.argv[1:] == ["rows"]:
    launcher._driver_host = lambda spark: None  # no store, no channel: allGather and result rows
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.driver.maxResultSize", "1m").getOrCreate())
spark.sparkContext.setLogLevel("OFF")
df = spark.createDataFrame([([float(i), 1.0], float(i)) for i in range(64)], ["features", "label"])
est = TorchEstimator(model=lambda c: torch.nn.Sequential(torch.nn.Linear(2, 1000), torch.nn.Linear(1000, 1000),
                                                         torch.nn.Linear(1000, 1)),
                     optimizer=lambda m, c: torch.optim.SGD(m.parameters(), lr=1e-6), loss=torch.nn.MSELoss(),
                     maxEpochs=1, numWorkers=2, showProgress=False)
try:
    est.fit(df)
    print("NO ERROR", len(est.checkpoint.to_bytes()))
except TrainingFailedError as error:
    print("ERROR", error.message)
spark.stop()
