"""Spark ML citizenship: Pipeline, CrossValidator, persistence, validation metrics and
evaluate() (classifiers: test_classifier.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchmetrics
from pyspark.ml import Pipeline
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.feature import VectorAssembler
from pyspark.ml.tuning import CrossValidator, CrossValidatorModel, ParamGridBuilder, TrainValidationSplit
from pyspark.sql import functions as F

from spark_torch_est import EarlyStopping, TorchEstimator, TorchModel
from spark_torch_est.errors import InvalidInputError
from tests.helpers import linear_estimator, mlp

pytestmark = pytest.mark.spark
SCRIPTS = Path(__file__).parent / "scripts"


def _mae(outputs, labels):
    return (outputs - labels).abs().mean()


#: This module's estimator: tests.helpers.linear_estimator with these settings.
SETTINGS = {"maxEpochs": 3}


@pytest.mark.compat
@pytest.mark.slow  # the saved pipeline loaded in a fresh process: about 20 s
def test_pipeline_fit_save_and_load_in_a_fresh_process(spark, wide_df, tmp_path):
    assembler = VectorAssembler(inputCols=[f"f{i}" for i in range(8)], outputCol="features")
    pipeline = Pipeline(stages=[assembler, linear_estimator(SETTINGS)])
    model = pipeline.fit(wide_df)
    expected = {r.id: r.prediction for r in model.transform(wide_df).select("id", "prediction").collect()}

    model.write().overwrite().save(str(tmp_path / "pipeline"))
    wide_df.write.parquet(str(tmp_path / "data"))
    pipeline.write().overwrite().save(str(tmp_path / "unfitted"))  # the estimator saves too
    result = subprocess.run([sys.executable, str(SCRIPTS / "score_saved_pipeline.py"), str(tmp_path / "pipeline"),
                             str(tmp_path / "data")], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    line = next(text for text in result.stdout.splitlines() if text.startswith("PREDICTIONS "))
    loaded = {i: p for i, p in json.loads(line[len("PREDICTIONS "):])}
    assert loaded.keys() == expected.keys()
    assert all(loaded[i] == expected[i] for i in expected)
    assert isinstance(Pipeline.load(str(tmp_path / "unfitted")).getStages()[1], TorchEstimator)


def test_a_saved_estimator_carries_its_run(spark, linear_df, tmp_path):
    est = linear_estimator(SETTINGS, config={"lr": 0.02})
    est.fit(linear_df, duration="1ep")
    est.save(str(tmp_path / "est"))
    loaded = TorchEstimator.load(str(tmp_path / "est"))
    assert loaded.progress == est.progress and loaded.getBatchSize() == 64 and loaded.getConfig() == {"lr": 0.02}
    loaded.fit(linear_df)
    assert loaded.progress.epoch == 3 and est.progress.epoch == 1


def test_a_directory_without_the_torch_files_is_refused_by_name(spark, tmp_path):
    linear_estimator(SETTINGS).save(str(tmp_path / "est"))
    shutil.rmtree(tmp_path / "est" / "torch")
    with pytest.raises(InvalidInputError, match="has Params but no torch/creators.pkl"):
        TorchEstimator.load(str(tmp_path / "est"))


def test_cross_validator_picks_the_better_batch_size_and_leaves_the_estimator_alone(spark, linear_df):
    est = linear_estimator(SETTINGS, maxEpochs=1, config={"lr": 0.01})
    grid = ParamGridBuilder().addGrid(est.batchSize, [512, 16]).build()
    evaluator = RegressionEvaluator(labelCol="label", predictionCol="prediction", metricName="rmse")
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, seed=3)
    cv_model = cv.fit(linear_df)
    best = int(np.argmin(cv_model.avgMetrics))
    assert cv_model.getEstimatorParamMaps()[best][est.batchSize] == 16
    assert cv_model.avgMetrics[1] < cv_model.avgMetrics[0] / 2
    assert isinstance(cv_model.bestModel, TorchModel)
    assert est.checkpoint is None and est.getBatchSize() == 64

    tvs = TrainValidationSplit(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, seed=3)
    assert isinstance(tvs.fit(linear_df).bestModel, TorchModel)
    assert est.checkpoint is None


def test_config_is_tuned_by_cross_validator_and_train_validation_split_and_saves_with_them(spark, linear_df,
                                                                                           tmp_path):
    est = linear_estimator(SETTINGS, maxEpochs=1, config={"lr": 0.05})
    grid = ParamGridBuilder().addGrid(est.getParam("config"), [{"lr": 0.0}, {"lr": 0.05}]).build()
    evaluator = RegressionEvaluator(labelCol="label", predictionCol="prediction", metricName="rmse")
    cv_model = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2,
                              seed=3).fit(linear_df)
    assert cv_model.avgMetrics[1] < cv_model.avgMetrics[0] / 2  # lr 0 never learns
    tvs_model = TrainValidationSplit(estimator=est, estimatorParamMaps=grid, evaluator=evaluator,
                                     seed=3).fit(linear_df)
    assert tvs_model.validationMetrics[1] < tvs_model.validationMetrics[0] / 2
    assert est.getConfig() == {"lr": 0.05} and est.checkpoint is None

    cv_model.save(str(tmp_path / "cv"))
    loaded = CrossValidatorModel.load(str(tmp_path / "cv"))
    assert [m[loaded.getEstimator().config] for m in loaded.getEstimatorParamMaps()] == [{"lr": 0.0}, {"lr": 0.05}]
    assert loaded.getEstimator().getConfig() == {"lr": 0.05}
    expected = [r.prediction for r in cv_model.transform(linear_df).collect()]
    assert [r.prediction for r in loaded.transform(linear_df).collect()] == expected


@pytest.mark.compat
def test_validation_loss_and_metrics_are_exact_over_all_validation_rows(spark, linear_df):
    df = linear_df.withColumn("is_val", F.rand(seed=4) < 0.25)
    est = linear_estimator(SETTINGS, model=mlp, validationIndicatorCol="is_val", maxEpochs=2,
                     metrics={"mae": _mae, "tm_mae": torchmetrics.MeanAbsoluteError()},
                     hooks=[EarlyStopping(monitor="val_mae", patience=5)])
    model = est.fit(df)
    val = df.filter("is_val").toPandas()
    x = torch.tensor(np.stack(val["features"].to_numpy()), dtype=torch.float32)
    with torch.no_grad():
        predicted = model.torch_model()(x).numpy().ravel()
    errors = predicted - val["label"].to_numpy()
    last = est.history[-1]
    assert last["val_loss"] == pytest.approx(float(np.mean(errors ** 2)), rel=1e-4)
    assert last["val_mae"] == pytest.approx(float(np.mean(np.abs(errors))), rel=1e-4)
    assert last["val_tm_mae"] == pytest.approx(float(np.mean(np.abs(errors))), rel=1e-4)

    evaluated = model.evaluate(df.filter("is_val"))
    assert evaluated["loss"] == pytest.approx(last["val_loss"], rel=1e-4)
    assert evaluated["mae"] == pytest.approx(last["val_mae"], rel=1e-4)
    assert evaluated["tm_mae"] == pytest.approx(last["val_mae"], rel=1e-4)
