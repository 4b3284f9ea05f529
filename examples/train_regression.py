"""Train an MLP on a Spark DataFrame with TorchEstimator, in two fits, then score it.

Runs unchanged with `python examples/train_regression.py` (local[*] from conf/ or the
default) and with `spark-submit [--master ...] examples/train_regression.py`. When mlflow
is installed, both fits are tracked as one MLflow run: at MLFLOW_TRACKING_URI when it is
set, else in a local store in a temporary folder, which the example prints.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile

import torch
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_torch_est import MLflowLogger, TorchEstimator

# Executors must run a Python that has torch; by default the one running this script.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def make_model(config: dict) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(config["features"], config["hidden"]), torch.nn.ReLU(),
        torch.nn.Linear(config["hidden"], 1),
    )


def make_optimizer(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=config["lr"])


def make_data(spark: SparkSession, rows: int = 20_000, features: int = 16):
    """y = sin(x0) + x1 * x2 + 0.5 x3 + noise, as a VectorAssembler-free array column."""
    df = spark.range(rows).select(
        F.array(*[F.randn(seed=i).cast("float") for i in range(features)]).alias("features")
    )
    x = F.col("features")
    return df.withColumn("label", F.sin(x[0]) + x[1] * x[2] + 0.5 * x[3] + 0.05 * F.randn(seed=99))


def tracking() -> tuple[list, str | None]:
    """An MLflowLogger and where it logs, or no logger without mlflow."""
    if importlib.util.find_spec("mlflow") is None:
        return [], None
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return [MLflowLogger(experiment_name="train_regression")], os.environ["MLFLOW_TRACKING_URI"]
    folder = tempfile.mkdtemp(prefix="spark_torch_est-mlflow-")
    uri = f"sqlite:///{folder}/mlflow.db"
    return [MLflowLogger(tracking_uri=uri, experiment_name="train_regression",
                         artifact_location=os.path.join(folder, "artifacts"))], uri


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # local[*] unless spark-submit --master or conf/spark-defaults.conf names another master
    spark = SparkSession.builder.appName("spark_torch_est example").getOrCreate()
    slots = spark.sparkContext.defaultParallelism
    df = make_data(spark).cache()
    train, test = df.randomSplit([0.9, 0.1], seed=1)
    loggers, tracking_uri = tracking()

    est = TorchEstimator(
        model=make_model, optimizer=make_optimizer, loss=torch.nn.MSELoss(),
        config={"features": 16, "hidden": 64, "lr": 3e-3},
        batchSize=128, maxEpochs=6, numWorkers=min(2, slots), seed=0,
        loggers=loggers,                                # run on the driver only
    )
    est.fit(train, duration="3ep")                      # the first half of the run ...
    print(f"after the first fit:  {est.progress}")
    model = est.fit(train)                              # ... resumed up to maxEpochs
    print(f"after the second fit: {est.progress}")

    print("\nloss per epoch:")
    for entry in est.history:
        print(f"  epoch {entry['epoch']}: train_loss {entry['train_loss']:.4f}")

    scored = model.transform(test).select("label", "prediction")
    rmse = scored.select(F.sqrt(F.avg((F.col("label") - F.col("prediction")) ** 2))).collect()[0][0]
    baseline = scored.select(F.stddev("label")).collect()[0][0]
    print(f"\ntest RMSE {rmse:.4f} (predicting the mean: {baseline:.4f})")
    print("sample predictions:")
    for row in scored.orderBy(F.rand(seed=3)).limit(5).collect():
        print(f"  label {row.label:+.3f}  prediction {row.prediction:+.3f}")
    if tracking_uri is not None:
        print(f"\nboth fits were logged as one MLflow run (experiment train_regression, tag "
              f"spark_torch_est.run_id={model.checkpoint.run_id}) at {tracking_uri}")
        print(f"browse it with: mlflow ui --backend-store-uri {tracking_uri}")
    spark.stop()


if __name__ == "__main__":
    main()
