"""Classifiers follow Spark ML's convention, so Spark's evaluators and tuners read them:
rawPrediction and probability Vectors, the class index as prediction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchmetrics
from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator
from pyspark.ml.linalg import VectorUDT
from pyspark.ml.tuning import CrossValidator, CrossValidatorModel, ParamGridBuilder
from pyspark.sql import types as T

from spark_torch_est import TorchEstimator, TorchModel
from tests.helpers import tasks_read_files

pytestmark = pytest.mark.spark


def _blobs(spark, classes: int, rows: int = 1200, seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=2.0, size=(classes, 4))
    labels = rng.integers(0, classes, size=rows)
    x = centers[labels] + rng.normal(size=(rows, 4))
    return spark.createDataFrame([(i, r.tolist(), int(c)) for i, (r, c) in enumerate(zip(x, labels))],
                                 ["id", "features", "label"])


def _mlp(config):
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, config["classes"]))


def _adam(model, config):
    return torch.optim.Adam(model.parameters(), lr=config.get("lr", 0.02))


def _classifier(classes: int, **params) -> TorchEstimator:
    settings = dict(model=_mlp, optimizer=_adam, loss=torch.nn.CrossEntropyLoss(), config={"classes": classes},
                    metrics={"accuracy": torchmetrics.Accuracy("multiclass", num_classes=classes)},
                    batchSize=32, maxEpochs=3, numWorkers=2, showProgress=False)
    settings.update(params)
    return TorchEstimator(**settings)


@pytest.fixture(scope="module")
def three(spark):
    df = _blobs(spark, 3)
    return df, _classifier(3).fit(df)


@pytest.fixture(scope="module")
def two(spark):
    df = _blobs(spark, 2, seed=1)
    return df, _classifier(2).fit(df)


def test_outputs_are_class_index_logit_and_probability_vectors(three):
    df, model = three
    scored = model.transform(df)
    types = {f.name: f.dataType for f in scored.schema.fields}
    assert types["prediction"] == T.DoubleType()
    assert isinstance(types["rawPrediction"], VectorUDT) and isinstance(types["probability"], VectorUDT)
    rows = scored.orderBy("id").collect()
    raw = np.array([r.rawPrediction.toArray() for r in rows])
    probability = np.array([r.probability.toArray() for r in rows])
    x = torch.tensor(np.array([r.features for r in rows]), dtype=torch.float32)
    np.testing.assert_allclose(raw, model.torch_model()(x).detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(probability, torch.softmax(torch.tensor(raw), dim=1).numpy(), rtol=1e-6)
    np.testing.assert_array_equal([r.prediction for r in rows], raw.argmax(axis=1))


@pytest.mark.compat
def test_multiclass_evaluator_reads_them_and_agrees_with_evaluate(three):
    df, model = three
    scored = model.transform(df)
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    log_loss = MulticlassClassificationEvaluator(metricName="logLoss").evaluate(scored)
    evaluated = model.evaluate(df)
    assert accuracy > 0.9
    assert evaluated["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert evaluated["loss"] == pytest.approx(log_loss, rel=1e-4)  # CrossEntropyLoss is the mean log loss


def test_a_parquet_table_read_by_the_tasks_gives_the_same_vectors_to_the_evaluators(three, spark, tmp_path):
    df, model = three
    df.write.parquet(str(tmp_path / "table"))
    table = spark.read.parquet(str(tmp_path / "table"))
    direct, through_spark = model.transform(table), model.copy({model.directRead: False}).transform(table)
    assert tasks_read_files(direct) and not tasks_read_files(through_spark)
    rows, expected = direct.orderBy("id").collect(), through_spark.orderBy("id").collect()
    for name in ("rawPrediction", "probability"):
        np.testing.assert_allclose([r[name].toArray() for r in rows], [r[name].toArray() for r in expected],
                                   rtol=1e-6, atol=1e-7)
    assert [r.prediction for r in rows] == [r.prediction for r in expected]
    evaluator = MulticlassClassificationEvaluator(metricName="logLoss")
    assert evaluator.evaluate(direct) == pytest.approx(evaluator.evaluate(through_spark), rel=1e-6)
    assert model.evaluate(table) == pytest.approx(model.copy({model.directRead: False}).evaluate(table), rel=1e-6)


def test_binary_evaluator_reads_raw_prediction_and_probability(two):
    df, model = two
    scored = model.transform(df)
    auc_raw = BinaryClassificationEvaluator().evaluate(scored)
    auc_probability = BinaryClassificationEvaluator(rawPredictionCol="probability").evaluate(scored)
    assert auc_raw > 0.95 and auc_probability == pytest.approx(auc_raw, abs=1e-3)


def test_an_empty_output_param_omits_its_column(three, spark):
    df, model = three
    assert model.copy({model.probabilityCol: ""}).transform(df).columns == df.columns + ["prediction", "rawPrediction"]
    assert model.copy({model.rawPredictionCol: "", model.predictionCol: ""}).transform(df).columns == \
        df.columns + ["probability"]
    nothing = model.copy({model.rawPredictionCol: "", model.predictionCol: "", model.probabilityCol: ""})
    assert nothing.transform(df).columns == df.columns


def test_output_names_set_on_the_estimator_reach_the_model_and_survive_save(two, tmp_path):
    df, _ = two
    est = _classifier(2, maxEpochs=1, rawPredictionCol="logits", probabilityCol="p")
    model = est.fit(df)
    model.save(str(tmp_path / "m"))
    loaded = TorchModel.load(str(tmp_path / "m"))
    assert loaded.transform(df).columns == df.columns + ["prediction", "logits", "p"]
    assert BinaryClassificationEvaluator(rawPredictionCol="logits").evaluate(loaded.transform(df)) > 0.9


def test_cross_validator_tunes_a_classifier_with_spark_evaluators(two, tmp_path):
    df, _ = two
    est = _classifier(2, maxEpochs=1, batchSize=64)
    grid = ParamGridBuilder().addGrid(est.maxEpochs, [1, 3]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=5,
                        evaluator=MulticlassClassificationEvaluator(metricName="logLoss"))
    cv_model = cv.fit(df)
    assert len(cv_model.avgMetrics) == 2
    assert cv_model.avgMetrics[1] < cv_model.avgMetrics[0]  # more epochs, lower log loss (smaller is better)
    assert isinstance(cv_model.bestModel, TorchModel) and cv_model.bestModel.checkpoint.progress.epoch == 3
    # the best model says what it was trained with, also once saved and loaded
    cv_model.save(str(tmp_path / "cv"))
    for model in cv_model.bestModel, CrossValidatorModel.load(str(tmp_path / "cv")).bestModel:
        trained = {p.name: v for p, v in model.extractParamMap().items()}
        assert model.getOrDefault(model.maxEpochs) == 3 and model.getOrDefault("batchSize") == 64
        assert {"numWorkers": 2, "seed": 0, "showProgress": False}.items() <= trained.items()
        assert model.isSet(model.batchSize) and not model.isSet(model.seed)  # set, or a default, as on the estimator


def test_string_indexer_labels_train_a_classifier_in_a_pipeline(spark):
    """Spark ML's indexers give whole-number doubles: with a k-output model they are class indices."""
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StringIndexer
    from pyspark.sql import functions as F

    colors = F.array(F.lit("red"), F.lit("green"), F.lit("blue"))
    color = F.element_at(colors, (F.col("label") + 1).cast("int")).alias("color")
    df = _blobs(spark, 3, rows=600, seed=2).select("id", "features", color)
    pipeline = Pipeline(stages=[StringIndexer(inputCol="color", outputCol="label"), _classifier(3, maxEpochs=4)])
    scored = pipeline.fit(df).transform(df)
    assert dict(scored.dtypes)["label"] == "double"
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored) > 0.9
