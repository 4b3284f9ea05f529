"""Spark Connect: the same estimator from a Connect client (no SparkContext on the client,
so rendezvous falls back to one allGather and the live channel is off).

A Connect session cannot share a process with the suite's classic one, so each script runs
in its own driver process; connect_ml.py runs the whole Spark ML matrix in one session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FEATURE_LAYOUTS

pytestmark = [pytest.mark.spark, pytest.mark.slow]
SCRIPTS = Path(__file__).parent / "scripts"


def _run(script: str) -> dict:
    pytest.importorskip("grpc", reason="pyspark[connect] extras are not installed")
    result = subprocess.run([sys.executable, str(SCRIPTS / script)], capture_output=True, text=True,
                            timeout=600, env=dict(os.environ))
    line = next((text for text in result.stdout.splitlines() if text.startswith("RESULT ")), None)
    assert line, result.stdout[-2000:] + result.stderr[-4000:]
    found = json.loads(line[len("RESULT "):])
    assert found["session"].startswith("pyspark.sql.connect")
    return found


def test_fit_and_transform_from_a_spark_connect_session():
    found = _run("connect_fit.py")
    assert found["epochs"] == 4 and found["weight_error"] < 0.05 and found["rmse"] < 0.05


@pytest.fixture(scope="module")
def ml():
    return _run("connect_ml.py")


@pytest.mark.parametrize("layout", FEATURE_LAYOUTS)
def test_fit_transform_and_evaluate_for_each_feature_layout(ml, layout):
    found = ml["layouts"][layout]
    assert found["prediction_error"] < 1e-5 and found["evaluate_error"] < 1e-4


def test_typed_inputs_fit_transform_and_evaluate(ml):
    found = ml["typed"]
    assert found["prediction_error"] < 1e-5 and found["evaluate_error"] < 1e-4
    assert found["table_prediction_error"] < 1e-5 and found["table_evaluate_error"] < 1e-4


def test_classifier_outputs_spark_evaluators_and_predict_udf(ml):
    found = ml["classifier"]
    assert found["types"]["prediction"] == "double"
    assert found["types"]["rawPrediction"] == found["types"]["probability"] == "vector"
    assert found["auc"] > 0.9
    assert found["log_loss"] == pytest.approx(found["evaluate_loss"], rel=1e-4)
    assert found["udf_equals_transform"]


def test_cross_validator(ml):
    found = ml["cross_validator"]
    assert found["metrics"][1] < found["metrics"][0] and found["best_epochs"] == 3


def test_config_tuned_by_train_validation_split_and_successive_halving(ml):
    found = ml["config_tuning"]
    assert found["tvs_metrics"][1] < 0.9 * found["tvs_metrics"][0]  # lr 0 never learns
    assert [(r["rung"], r["index"], r["kept"]) for r in found["rungs"]] == [(0, 0, False), (0, 1, True), (1, 1, True)]
    assert found["best_epochs"] == 2 and found["best_predicts"] == 300


def test_save_and_load_of_models_estimators_and_pipelines(ml):
    found = ml["persistence"]
    assert found["model_equal"] and found["pipeline_equal"]
    assert found["estimator_progress"] == [2, 2] and found["estimator_continues"] == 3
