"""fit(df, params) as pyspark.ml.Estimator.fit has it, with duration and resume_from on top."""

from __future__ import annotations

import pytest

from spark_torch_est import TorchModel
from tests.helpers import linear_estimator, spark_jobs_started

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def small_df(linear_df):
    return linear_df.limit(400).cache()


#: This module's estimator: tests.helpers.linear_estimator with these settings.
SETTINGS = {"maxEpochs": 3}


@pytest.mark.parametrize("params", ["", "maxEpochs=1", 3, {1, 2}])
def test_anything_but_a_dict_or_a_list_is_a_type_error_before_any_job(spark, small_df, params):
    est = linear_estimator(SETTINGS)
    jobs = spark_jobs_started(spark)
    with pytest.raises(TypeError, match="Params must be either a param map or a list/tuple of param maps"):
        est.fit(small_df, params)
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None


@pytest.mark.parametrize("params", [[], ()])
def test_an_empty_list_of_param_maps_trains_nothing(spark, small_df, params):
    est = linear_estimator(SETTINGS)
    jobs = spark_jobs_started(spark)
    assert est.fit(small_df, params) == []
    assert est.fit(small_df, params, duration="1ep") == []
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None


def test_a_param_map_trains_a_copy_and_leaves_the_run_alone(small_df):
    est = linear_estimator(SETTINGS)
    est.fit(small_df, {}, duration="1ep")  # an empty map is a plain fit: it continues this run
    assert est.progress.epoch == 1
    model = est.fit(small_df, {est.maxEpochs: 1, est.batchSize: 32})  # this run is at maxEpochs=1 already
    assert model.checkpoint.progress.epoch == 1 and model.getPredictionCol() == "prediction"
    assert est.progress.epoch == 1 and est.getMaxEpochs() == 3 and est.getBatchSize() == 64


def test_a_list_of_param_maps_returns_one_new_run_per_map(small_df):
    est = linear_estimator(SETTINGS)
    est.fit(small_df, duration="1ep")
    models = est.fit(small_df, [{est.maxEpochs: 1}, {est.maxEpochs: 2, est.predictionCol: "p"}])
    assert [type(m) for m in models] == [TorchModel, TorchModel]
    assert [m.checkpoint.progress.epoch for m in models] == [1, 2]
    assert models[1].getPredictionCol() == "p" and "p" in models[1].transform(small_df).columns
    assert est.progress.epoch == 1


def test_duration_and_resume_from_apply_to_each_param_map(small_df):
    est = linear_estimator(SETTINGS)
    start = est.fit(small_df, duration="1ep")
    models = est.fit(small_df, ({est.batchSize: 32}, {est.batchSize: 128}), duration="1ep", resume_from=start)
    assert [m.checkpoint.progress.epoch for m in models] == [2, 2]  # resumed at epoch 1, not restarted
    fresh = est.fit(small_df, [{est.seed: 1}], duration="1ep")
    assert fresh[0].checkpoint.progress.epoch == 1
    assert est.progress.epoch == 1


def test_a_param_map_with_a_duration_warns_that_each_call_is_a_new_run_and_how_to_continue(small_df):
    """The pyspark.ml way, ``fit(df, {config: cfg}, duration="1ep")`` in an epoch loop, trains
    epoch 1 again and again: it says so, and names the way that continues."""
    est = linear_estimator(SETTINGS)
    with pytest.warns(UserWarning, match=r"a new run each call.*est.copy\(params\).*fit\(df, duration=...\) on that"):
        first = est.fit(small_df, {est.batchSize: 32}, duration="1ep")
    assert first.history[-1]["epoch"] == 1
    stepped = est.copy({est.batchSize: 32})
    assert [stepped.fit(small_df, duration="1ep").history[-1]["epoch"] for _ in range(2)] == [1, 2]
