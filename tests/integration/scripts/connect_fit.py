"""Run by test_connect.py: fit and transform from a Spark Connect session (local server)."""

import json
import os
import sys

import numpy as np
import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import TorchEstimator  # noqa: E402
from tests.helpers import linear_model, sgd  # noqa: E402

spark = SparkSession.builder.remote("local[2]").getOrCreate()
rng = np.random.default_rng(0)
x = rng.normal(size=(2000, 8))
w = rng.normal(size=8)
df = spark.createDataFrame([(r.tolist(), float(r @ w + 0.5)) for r in x], ["features", "label"])
est = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), maxEpochs=4, numWorkers=2,
                     showProgress=False)
est.fit(df, duration="2ep")
model = est.fit(df)
predictions = model.transform(df).select("label", "prediction").toPandas()
print("RESULT " + json.dumps({
    "session": type(spark).__module__,
    "epochs": est.progress.epoch,
    "weight_error": float(np.abs(model.torch_model().weight.detach().numpy().ravel() - w).max()),
    "rmse": float(np.sqrt(((predictions.label - predictions.prediction) ** 2).mean())),
}))
spark.stop()
