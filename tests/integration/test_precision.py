"""precision and compileModel end to end on local[2]: fit, transform, evaluate, predict_udf, save/load."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from spark_torch_est import TorchEstimator, TorchModel
from spark_torch_est.core.support import PREDICT_UDF, installed
from spark_torch_est.errors import InvalidInputError
from tests.helpers import adam, linear_model, mlp, spark_jobs_started

pytestmark = pytest.mark.spark


def test_an_unknown_precision_is_refused_before_any_job(spark, linear_df):
    est = TorchEstimator(model=linear_model, optimizer=adam, loss=torch.nn.MSELoss(), precision="fp8",
                         showProgress=False)
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match="precision must be one of '32', 'bf16-mixed', '16-mixed', got 'fp8'"):
        est.fit(linear_df)
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None


@pytest.mark.compat
def test_bf16_training_transform_evaluate_and_predict_udf_run_under_the_same_autocast(spark, linear_df,
                                                                                        tmp_path):
    est = TorchEstimator(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(), config={"width": 64}, batchSize=64,
                         maxEpochs=2, numWorkers=2, seed=5, precision="bf16-mixed", showProgress=False)
    model = est.fit(linear_df)
    assert model.checkpoint.precision == "bf16-mixed"
    assert {v.dtype for v in model.checkpoint.model_state.values()} == {torch.float32}
    assert est.history[-1]["train_loss"] < est.history[0]["train_loss"]

    rows = linear_df.limit(200).toPandas()
    x = torch.tensor(np.stack(rows.features.to_numpy()), dtype=torch.float32)
    y = torch.tensor(rows.label.to_numpy(), dtype=torch.float32).reshape(-1, 1)
    plain = model.torch_model()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain(x)
        expected_loss = float(torch.nn.functional.mse_loss(expected, y))
    assert expected.dtype == torch.bfloat16
    with torch.no_grad():
        full = plain(x).reshape(-1).numpy()
    expected = expected.float().reshape(-1).numpy()
    assert not np.array_equal(expected, full), "bfloat16 and float32 forwards differ on this model"

    frame = spark.createDataFrame(rows).coalesce(1)
    if installed("pyspark") >= PREDICT_UDF.needs:
        predicted = frame.select("features", model.predict_udf()("features").alias("p")).toPandas()
        np.testing.assert_array_equal(predicted.p.to_numpy(dtype=np.float32), expected)
    else:
        with pytest.raises(InvalidInputError, match=r"predict_udf\(\) needs pyspark >= 4.1"):
            model.predict_udf()
    model.save(str(tmp_path / "m"))
    loaded = TorchModel.load(str(tmp_path / "m"))
    transformed = loaded.setDirectRead(False).transform(frame).toPandas()
    np.testing.assert_array_equal(transformed.prediction.to_numpy(dtype=np.float32), expected)
    assert loaded.evaluate(frame)["loss"] == pytest.approx(expected_loss, rel=1e-6)


@pytest.mark.slow  # two ranks each compile the model, each fit: ~1-2 minutes on 2 shared cores
def test_a_compiled_fit_on_two_ranks_reports_its_compile_time_and_keeps_plain_keys(spark, linear_df, tmp_path,
                                                                                   caplog):
    est = TorchEstimator(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(), batchSize=100, maxEpochs=2,
                         numWorkers=2, seed=5, compileModel=True, showProgress=False)
    with caplog.at_level(logging.INFO, logger="spark_torch_est.worker"):
        est.fit(linear_df, duration="1ep")
        model = est.fit(linear_df)  # a second compiled fit in the same Python workers resumes the run
    notes = [r.getMessage() for r in caplog.records if "compileModel: the first step" in r.getMessage()]
    assert len(notes) == 2, notes  # once per fit
    assert "still referenced after training" not in caplog.text
    keys = set(mlp({}).state_dict())
    assert set(model.checkpoint.model_state) == keys and set(model.torch_model().state_dict()) == keys
    model.save(str(tmp_path / "m"))
    assert set(TorchModel.load(str(tmp_path / "m")).checkpoint.model_state) == keys
    assert est.history[-1]["train_loss"] < est.history[0]["train_loss"]
