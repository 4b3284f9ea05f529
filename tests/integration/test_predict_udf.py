"""model.predict_udf(): the model as a batched column function for withColumn, select and SQL,
with transform's values and transform's per-worker model."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F
from pyspark.sql.utils import PythonException

from spark_torch_est import TorchEstimator
from spark_torch_est.errors import InvalidInputError
from tests.helpers import sgd

pytestmark = pytest.mark.spark


def _logged_linear(config):
    """nn.Linear(8, outputs) that notes each construction (the process id) in config["log"]."""
    with open(config["log"], "a") as log:
        log.write(f"{os.getpid()}\n")
    return torch.nn.Linear(8, config.get("outputs", 1))


def _builds(path) -> collections.Counter:
    return collections.Counter(path.read_text().split())


@pytest.fixture(scope="module")
def fitted(spark, linear_df, tmp_path_factory):
    log = tmp_path_factory.mktemp("builds") / "log"
    est = TorchEstimator(model=_logged_linear, optimizer=sgd, loss=torch.nn.MSELoss(), config={"log": str(log)},
                         maxEpochs=1, numWorkers=2, showProgress=False)
    return est.fit(linear_df.limit(500)), log


def _by_id(df, column):
    return [r[column] for r in df.orderBy("id").select(column).collect()]


def test_with_column_and_select_give_transform_s_predictions_from_its_cached_model(linear_df, fitted):
    model, log = fitted
    df = linear_df.withColumn("id", F.monotonically_increasing_id())
    before = _builds(log)
    expected = _by_id(model.transform(df), "prediction")
    predict = model.predict_udf()
    assert _by_id(df.withColumn("p", predict("features")), "p") == expected
    assert _by_id(df.select("id", predict(F.col("features")).alias("p")), "p") == expected
    new = _builds(log) - before
    assert new and max(new.values()) == 1, f"a Python worker built the model more than once: {new}"


def test_sql_and_feature_columns(spark, wide_df, fitted):
    model, _ = fitted
    names, wide = [f"f{i}" for i in range(8)], wide_df
    wide_model = model.copy({model.featuresCol: None, model.featureCols: names})
    expected = _by_id(wide_model.transform(wide), "prediction")
    spark.udf.register("predict_price", wide_model.predict_udf())
    wide.createOrReplaceTempView("houses")
    try:
        scored = spark.sql(f"SELECT id, predict_price({', '.join(names)}) AS p FROM houses")
        assert _by_id(scored, "p") == expected
    finally:
        spark.catalog.dropTempView("houses")


def test_vector_columns_dense_and_sparse(spark, fitted):
    model, _ = fitted
    rng = np.random.default_rng(3)
    x = rng.normal(size=(200, 8)) * (rng.random(size=(200, 8)) < 0.5)
    rows = [(i, Vectors.sparse(8, {j: float(v) for j, v in enumerate(r) if v}) if i % 2 else Vectors.dense(r.tolist()))
            for i, r in enumerate(x)]
    df = spark.createDataFrame(rows, ["id", "vec"])
    predicted = _by_id(df.withColumn("p", model.predict_udf()("vec")), "p")
    expected = model.torch_model()(torch.tensor(x, dtype=torch.float32)).detach().numpy().ravel()
    np.testing.assert_allclose(predicted, expected, rtol=1e-5, atol=1e-6)


def test_classifier_outputs(spark):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(400, 8))
    df = spark.createDataFrame([(i, r.tolist(), int(r[0] > 0)) for i, r in enumerate(x)], ["id", "features", "label"])
    est = TorchEstimator(model=lambda c: torch.nn.Linear(8, 2), optimizer=sgd, loss=torch.nn.CrossEntropyLoss(),
                         maxEpochs=1, numWorkers=2, showProgress=False)
    model = est.fit(df)
    scored = model.transform(df)
    for output, column in (("prediction", "prediction"), ("rawPrediction", "rawPrediction"),
                           ("probability", "probability")):
        assert _by_id(df.withColumn("u", model.predict_udf(output)("features")), "u") == _by_id(scored, column)
    with pytest.raises(InvalidInputError, match="'prediction', 'rawPrediction', 'probability'"):
        model.predict_udf("logits")

    spark.udf.register("class_probabilities", model.predict_udf("probability", as_array=True))
    df.createOrReplaceTempView("points")
    sql = spark.sql("SELECT id, class_probabilities(features)[1] AS p1 FROM points")  # SQL indexes arrays, not Vectors
    expected = {r.id: float(r.probability[1]) for r in scored.select("id", "probability").collect()}
    assert {r.id: r.p1 for r in sql.collect()} == expected


def test_several_outputs_and_the_wrong_number_of_columns(linear_df, fitted, tmp_path):
    model, _ = fitted
    with pytest.raises(InvalidInputError, match="offers 'prediction'$"):
        model.predict_udf("probability")
    with pytest.raises(PythonException, match=r"predict_udf\(\) takes 1 column\(s\) .*got 2"):
        linear_df.select(model.predict_udf()("features", "label")).collect()
    est = TorchEstimator(model=_logged_linear, optimizer=sgd, loss=torch.nn.MSELoss(),
                         config={"log": str(tmp_path / "log"), "outputs": 2}, maxEpochs=1, showProgress=False)
    two = est.fit(linear_df.limit(200).withColumn("label", F.array("label", "label")))
    df = linear_df.limit(50).withColumn("id", F.monotonically_increasing_id())
    assert _by_id(df.withColumn("p", two.predict_udf()("features")), "p") == _by_id(two.transform(df), "prediction")
