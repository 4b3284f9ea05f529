"""Run by test_kept.py: a fit keeps its rows under Spark's local directory (``argv[1]``),
and they are gone once the session stops. Prints ``{"before": n, "after": n}``, the kept
parts before and after ``spark.stop()``."""

import glob
import json
import os
import sys

import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import TorchEstimator  # noqa: E402

local_dir = sys.argv[1]
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.local.dir", local_dir).getOrCreate())
kept = os.path.join(local_dir, "blockmgr-*", "spark_torch_est-kept", "*", "part-*")
try:
    df = spark.range(0, 400, 1, 2).selectExpr("array(cast(id % 7 as float), 1.0f) as features",
                                              "cast(id % 7 as double) as label")
    TorchEstimator(model=torch.nn.Linear(2, 1), optimizer=lambda m, c: torch.optim.SGD(m.parameters(), lr=1e-3),
                   loss=torch.nn.MSELoss(), maxEpochs=1, numWorkers=2, batchSize=8, showProgress=False).fit(df)
    before = len(glob.glob(kept))
finally:
    spark.stop()
print(json.dumps({"before": before, "after": len(glob.glob(kept))}))
