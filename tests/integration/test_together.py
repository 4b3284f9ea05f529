"""A tuner's maps trained together: ``fitMultiple`` trains a split's maps in one barrier job,
each model the one its own fit gives, handed out as its run ends; anything else (and a job
that fails) falls back to one fit per map."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from pyspark import TaskContext
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from torch import nn

from spark_torch_est import TorchModel
from spark_torch_est.errors import InvalidInputError, TrainingFailedError
from tests.helpers import CountSteps, estimator, flat_weights, mlp

pytestmark = pytest.mark.spark

SETTINGS = {"maxEpochs": 2, "batchSize": 64}


def _launches(caplog) -> int:
    """Training jobs the fit's log says were launched."""
    return sum(r.getMessage().startswith("launching training job") for r in caplog.records)


def _mlp_that_fails_in_tasks(config: dict) -> nn.Module:
    """The tests' MLP; with ``config["fail_in_tasks"]``, a creator that fails in a Spark task only
    (the driver's check builds it fine)."""
    if config.get("fail_in_tasks") and TaskContext.get() is not None:
        raise RuntimeError("this map's model cannot be built on the executors")
    return mlp(config)


@pytest.fixture(scope="module")
def small_df(linear_df):
    return linear_df.limit(600).cache()


@pytest.fixture(scope="module", params=["cached", "shuffled", "parquet"])
def source(request, spark, small_df, tmp_path_factory):
    """The rows as each way of placing them gives them: in the cache's order (logical
    partitions), through a shuffle (hashed), or read by the ranks from a table's files."""
    if request.param == "cached":
        return "spark:positions", small_df
    if request.param == "shuffled":
        return "spark", small_df.repartition(3)
    path = str(tmp_path_factory.mktemp("together") / "table")
    small_df.coalesce(2).write.parquet(path)
    return "files", spark.read.parquet(path)


@pytest.mark.compat
def test_a_splits_maps_train_in_one_job_and_each_model_is_bitwise_its_own_fit(spark, source, caplog):
    placed, small_df = source
    est = estimator(SETTINGS, hooks=[CountSteps()])
    config = est.getConfig()
    maps = [{est.config: {**config, "width": 8, "lr": 0.02}},
            {est.config: {**config, "width": 32}, est.batchSize: 32, est.seed: 5},
            {est.config: {**config, "lr": 0.001}, est.maxEpochs: 3}]
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        together = dict(est.fitMultiple(small_df, maps))
    assert _launches(caplog) == 1
    assert any("train the 3 maps of split 1 in turn" in r.getMessage() for r in caplog.records)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert est.checkpoint is None  # the tuned estimator is left as it was

    for index, params in enumerate(maps):
        alone = est.copy(params).fit(small_df)
        mine = together[index]
        assert isinstance(mine, TorchModel)
        assert np.array_equal(flat_weights(mine), flat_weights(alone))
        assert mine.checkpoint.progress == alone.checkpoint.progress
        assert mine.checkpoint.history == alone.checkpoint.history
        assert mine.checkpoint.hook_states == alone.checkpoint.hook_states  # each map's own copy of the hooks
        assert mine.getOrDefault("batchSize") == params.get(est.batchSize, 64)
    assert together[2].checkpoint.progress.epoch == 3 and together[0].checkpoint.progress.epoch == 2
    for model in together.values():  # the rows placed as this source places them
        read = model.checkpoint.data_source
        assert read == placed or (placed == "files" and read.startswith("files:"))


def test_cross_validator_gets_the_same_metrics_from_maps_trained_together_as_one_at_a_time(spark, small_df, caplog):
    est = estimator(SETTINGS, numWorkers=1)
    config = est.getConfig()
    evaluator = RegressionEvaluator(metricName="rmse")
    lrs = [0.03, 0.001]
    together = ParamGridBuilder().addGrid(est.config, [{**config, "lr": lr} for lr in lrs]).build()
    # the same maps, each also setting a Param that is not trained together (to its own value)
    alone = [{**params, est.labelCol: "label"} for params in together]
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        by_one_job = CrossValidator(estimator=est, estimatorParamMaps=together, evaluator=evaluator, numFolds=2,
                                    seed=4).fit(small_df)
        jobs_together = _launches(caplog)
        caplog.clear()
        by_map = CrossValidator(estimator=est, estimatorParamMaps=alone, evaluator=evaluator, numFolds=2,
                                seed=4).fit(small_df)
    assert jobs_together == 2 + 1  # a job per fold and the refit
    assert _launches(caplog) == 2 * 2 + 1
    assert any("fitted one at a time: a map sets labelCol" in r.getMessage() for r in caplog.records)
    assert by_one_job.avgMetrics == by_map.avgMetrics
    assert by_one_job.avgMetrics[0] < by_one_job.avgMetrics[1]  # the model learns: the larger rate wins
    assert np.array_equal(flat_weights(by_one_job.bestModel), flat_weights(by_map.bestModel))


def test_a_map_the_driver_refuses_is_refused_when_its_model_is_asked_for(spark, small_df, caplog):
    est = estimator(SETTINGS)
    maps = [{est.config: est.getConfig()}, {est.batchSize: 0}]
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        models = est.fitMultiple(small_df, maps)
        index, model = next(models)
        assert index == 0 and isinstance(model, TorchModel)
        with pytest.raises(InvalidInputError, match="batchSize must be at least 1"):
            next(models)
    assert any("fitted one at a time: a map's fit is refused" in r.getMessage() for r in caplog.records)


def test_a_job_that_fails_leaves_each_map_to_its_own_fit_which_raises_its_own_error(spark, small_df, caplog):
    est = estimator(SETTINGS, model=_mlp_that_fails_in_tasks, maxRetries=0)
    maps = [{est.config: est.getConfig()}, {est.config: {**est.getConfig(), "fail_in_tasks": True}}]
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        models = est.fitMultiple(small_df, maps)
        index, model = next(models)
        assert index == 0 and np.array_equal(flat_weights(model), flat_weights(est.copy(maps[0]).fit(small_df)))
        with pytest.raises(TrainingFailedError, match="cannot be built on the executors"):
            next(models)
    assert any("together in one job failed" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
