"""Run by test_daemon.py: a session whose Python workers are forked from
``spark_torch_est.daemon``. Prints one JSON line: whether the first job's workers had torch
and ``torch._dynamo`` (which ``DistributedDataParallel`` imports) before their task imported
anything, the losses of a fit on two ranks, and its model's
predictions and evaluation there."""

import json
import os
import sys

import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import TorchEstimator  # noqa: E402


def had_torch(batches):
    import sys

    import pyarrow as pa

    for _ in batches:
        pass
    yield pa.RecordBatch.from_pylist([{"torch": "torch" in sys.modules, "dynamo": "torch._dynamo" in sys.modules}])


spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.python.daemon.module", "spark_torch_est.daemon").getOrCreate())
try:
    preloaded = [[row.torch, row.dynamo] for row in
                 spark.range(2, numPartitions=2).mapInArrow(had_torch, "torch boolean, dynamo boolean").collect()]
    df = spark.createDataFrame([([float(i % 7), 1.0], 2.0 * (i % 7)) for i in range(256)], ["features", "label"])
    est = TorchEstimator(model=torch.nn.Linear(2, 1), optimizer=lambda m, c: torch.optim.SGD(m.parameters(), lr=0.01),
                         loss=torch.nn.MSELoss(), maxEpochs=3, numWorkers=2, batchSize=16, showProgress=False)
    model = est.fit(df)
    scored = model.transform(df).select("label", "prediction").collect()
    mse = sum((row.label - row.prediction) ** 2 for row in scored) / len(scored)
    print(json.dumps({"preloaded": preloaded, "losses": [epoch["train_loss"] for epoch in est.history],
                      "scored": len(scored), "mse": mse, "evaluated": model.evaluate(df)["loss"]}))
finally:
    spark.stop()
