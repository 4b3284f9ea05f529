"""Batched scoring in a task, without Spark: the same numbers as the model, one model per process."""

import hashlib
import io

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest
import torch
import torchmetrics

from spark_torch_est.creators import Creators
from spark_torch_est.inference import ScoringSpec, evaluate_task, load_model, predict_task
from spark_torch_est.metrics import MetricAccumulator
from spark_torch_est.protocol import FEATURES, LABEL
from tests.helpers import adam, arrow_batches, mlp


def _spec(**fields) -> tuple[ScoringSpec, torch.nn.Module]:
    torch.manual_seed(0)
    model = mlp({})
    creators = Creators(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(),
                        metrics={"mse": torchmetrics.MeanSquaredError()})
    weights = io.BytesIO()
    torch.save(model.state_dict(), weights)
    spec = ScoringSpec(key=hashlib.sha256(weights.getvalue()).hexdigest(), creators=cloudpickle.dumps(creators),
                       weights=weights.getvalue(), batch_size=7, **fields)
    return spec, model.eval()


def test_predictions_equal_the_models_forward_in_any_chunking():
    spec, model = _spec()
    batches = arrow_batches(50)
    out = list(predict_task(spec)(iter(batches)))
    predicted = np.concatenate([b.column("prediction").to_numpy() for b in out])
    x = torch.from_numpy(np.stack(batches[0].column(FEATURES).to_numpy(zero_copy_only=False)))
    with torch.no_grad():
        expected = model(x).reshape(-1).numpy()
    np.testing.assert_allclose(predicted, expected, rtol=1e-6)
    assert FEATURES not in out[0].schema.names and LABEL in out[0].schema.names


def test_the_model_is_built_once_per_process_and_weights():
    spec, _ = _spec()
    assert load_model(spec) is load_model(spec)


def test_evaluation_totals_combine_to_the_loss_over_every_row():
    spec, model = _spec(features_col=FEATURES)
    batches = arrow_batches(50)
    row = next(evaluate_task(spec)(iter(batches)))
    totals = torch.tensor(row.column("totals")[0].as_py(), dtype=torch.float64)
    x = torch.from_numpy(np.stack(batches[0].column(FEATURES).to_numpy(zero_copy_only=False)))
    y = torch.tensor(batches[0].column(LABEL).to_numpy()).reshape(-1, 1)
    with torch.no_grad():
        expected = float(torch.nn.functional.mse_loss(model(x), y))
    accumulator = MetricAccumulator(torch.nn.MSELoss(), {"mse": torchmetrics.MeanSquaredError()}, torch.device("cpu"))
    accumulator.merge("mse", row.column("metric_states")[0][0].as_py())
    results = accumulator.results(totals)
    assert totals[0] == 50 and results["loss"] == pytest.approx(expected, rel=1e-5)
    assert results["mse"] == pytest.approx(expected, rel=1e-5)


def test_numeric_feature_columns_are_stacked():
    spec, model = _spec(feature_cols=tuple(f"x{i}" for i in range(8)))
    x = np.random.default_rng(1).normal(size=(9, 8)).astype(np.float32)
    batch = pa.RecordBatch.from_arrays([pa.array(x[:, i]) for i in range(8)], [f"x{i}" for i in range(8)])
    out = next(predict_task(spec)(iter([batch])))
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).reshape(-1).numpy()
    np.testing.assert_allclose(out.column("prediction").to_numpy(), expected, rtol=1e-6)
    assert out.schema.names == [f"x{i}" for i in range(8)] + ["prediction"]
