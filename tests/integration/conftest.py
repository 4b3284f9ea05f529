"""One local[2] SparkSession for the whole integration suite (several fits per session is
itself part of what is tested)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("spark_torch_est-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def linear_data():
    """y = X w + b with 8 features, as numpy arrays (rows, weights, bias)."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(3000, 8)).astype(np.float32)
    w = rng.normal(size=8).astype(np.float32)
    b = np.float32(0.5)
    y = x @ w + b
    return x, y, w, b


@pytest.fixture(scope="session")
def linear_df(spark, linear_data):
    """The linear data as an array<double> features column plus a double label."""
    x, y, _, _ = linear_data
    return spark.createDataFrame([(row.tolist(), float(t)) for row, t in zip(x, y)], ["features", "label"])


@pytest.fixture(scope="session")
def wide_df(linear_df):
    """The linear data with its features in columns ``f0`` to ``f7``, beside an ``id`` and
    the label."""
    from pyspark.sql import functions as F

    columns = [F.col("features")[i].alias(f"f{i}") for i in range(8)]
    return linear_df.select(F.monotonically_increasing_id().alias("id"), *columns, "label")


@pytest.fixture
def store(tmp_path):
    """A sqlite MLflow tracking store with an experiment "tests" whose artifacts stay in
    tmp_path: (tracking URI, MlflowClient, experiment id)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("tests", artifact_location=str(tmp_path / "artifacts"))
    return uri, client, experiment_id
