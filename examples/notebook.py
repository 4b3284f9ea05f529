# Databricks notebook source
# MAGIC %md
# MAGIC # Train a PyTorch model on a DataFrame, one cell at a time
# MAGIC
# MAGIC A notebook in Databricks source format: import it into a workspace, or run it top to
# MAGIC bottom on your machine with `python examples/notebook.py`. On a cluster, `spark`
# MAGIC already exists; locally the first cell makes a `local[*]` session.

# COMMAND ----------

import os
import sys
import tempfile

import torch
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_torch_est import EarlyStopping, TorchEstimator, TorchModel

if "spark" not in globals():  # outside Databricks
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master("local[*]").appName("notebook").getOrCreate()
workers = min(2, spark.sparkContext.defaultParallelism)

# COMMAND ----------

# MAGIC %md Data: four numeric columns, assembled into a Vector as most Spark ML pipelines do.

# COMMAND ----------

raw = spark.range(8_000).select(*[F.randn(seed=i).alias(f"x{i}") for i in range(4)])
raw = raw.withColumn("y", 2 * F.col("x0") - F.col("x1") + F.col("x2") * F.col("x3") + 0.1 * F.randn(seed=9))
df = (VectorAssembler(inputCols=[f"x{i}" for i in range(4)], outputCol="features").transform(raw)
      .withColumn("is_val", F.rand(seed=3) < 0.2).cache())

# COMMAND ----------

# MAGIC %md Creators defined in a notebook cell are pickled by value and shipped to the executors.

# COMMAND ----------


def make_model(config):
    hidden = config["hidden"]
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def make_optimizer(model, config):
    return torch.optim.Adam(model.parameters(), lr=config["lr"])


stopper = EarlyStopping(monitor="val_loss", patience=2)
est = TorchEstimator(model=make_model, optimizer=make_optimizer, loss=torch.nn.MSELoss(),
                     config={"hidden": 32, "lr": 0.01}, labelCol="y", validationIndicatorCol="is_val",
                     metrics={"mae": lambda out, y: (out - y).abs().mean()},
                     batchSize=128, maxEpochs=12, numWorkers=workers, hooks=[stopper])

# COMMAND ----------

# MAGIC %md Train a little, look, then go on: each `fit` continues the same run.

# COMMAND ----------

est.fit(df, duration="3ep")
for entry in est.history:
    print(entry)

# COMMAND ----------

model = est.fit(df)
print(est.progress, "| early stopping:", stopper.stopped_epoch or "did not stop")
print("last epoch:", est.history[-1])

# COMMAND ----------

# MAGIC %md Score, evaluate, save and load (use a `dbfs:/` or cloud path on a cluster).

# COMMAND ----------

model.transform(df).select("y", "prediction").show(5)
print("evaluate on the validation rows:", model.evaluate(df.filter("is_val")))
path = os.path.join(tempfile.mkdtemp(), "model")
model.save(path)
print("reloaded:", TorchModel.load(path).transform(df).count(), "rows scored")
