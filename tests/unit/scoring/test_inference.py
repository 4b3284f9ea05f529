"""Batched scoring in a task, without Spark: the same numbers as the model, one model per process."""

import dataclasses
import gc
import hashlib
import io
import time

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest
import torch
import torchmetrics

from spark_torch_est.core.schema import INPUTS_LAYOUT, InputColumn, InputSchema
from spark_torch_est.scoring.inference import ScoringSpec, evaluate_task, load_model, predict_task
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.metrics import MetricAccumulator
from tests.helpers import adam, features_schema, mlp, with_column


def _spec(model_creator=mlp, schema=None, columns=("x",), **fields) -> tuple[ScoringSpec, torch.nn.Module]:
    torch.manual_seed(0)
    model = model_creator({})
    creators = Creators(model=model_creator, optimizer=adam, loss=torch.nn.MSELoss(),
                        metrics={"mse": torchmetrics.MeanSquaredError()})
    weights = io.BytesIO()
    torch.save(model.state_dict(), weights)
    spec = ScoringSpec(key=hashlib.sha256(weights.getvalue()).hexdigest(), creators=cloudpickle.dumps(creators),
                       weights=weights.getvalue(), batch_size=7, schema=(schema or features_schema(8)).to_dict(),
                       columns=tuple(columns), **fields)
    return spec, model.eval()


def _table(rows: int = 50, seed: int = 0) -> tuple[pa.RecordBatch, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    y = (x.sum(axis=1) + 1).astype(np.float32)
    batch = pa.RecordBatch.from_arrays([pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8), pa.array(y)],
                                       ["x", "y"])
    return batch, x, y


def test_predictions_equal_the_models_forward_in_any_chunking():
    spec, model = _spec()
    batch, x, _ = _table()
    out = list(predict_task(spec)(iter([batch])))
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).reshape(-1).numpy()
    np.testing.assert_allclose(out[0].column("prediction").to_numpy(), expected, rtol=1e-6)
    assert out[0].schema.names == ["x", "y", "prediction"], "the input's columns are kept as they are"


def test_the_model_is_built_once_per_process_and_weights():
    spec, _ = _spec()
    assert load_model(spec) is load_model(spec)


def test_a_scoring_task_leaves_the_objects_it_found_out_of_the_collection_after_it():
    """A reused Python worker collects after each task: with torch imported that walks some
    350,000 objects unless they were frozen when the task started (see core/worker_gc.py)."""
    spec, _ = _spec()
    batch, _, _ = _table()
    gc.unfreeze()
    try:
        list(predict_task(spec)(iter([batch])))
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch's objects, the package's, the cached model
        started = time.perf_counter()
        gc.collect()
        after_task = time.perf_counter() - started
        gc.unfreeze()
        started = time.perf_counter()
        gc.collect()
        assert after_task < (time.perf_counter() - started) / 3
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("weighted", [False, True])
def test_evaluation_totals_combine_to_the_loss_over_every_row(weighted):
    spec, model = _spec(label_col="y", weight_col="w" if weighted else None)
    batch, x, y = _table()
    w = np.linspace(0.0, 2.0, len(x)).astype(np.float32)
    row = next(evaluate_task(spec)(iter([with_column(batch, "w", pa.array(w))])))
    totals = torch.tensor(row.column("totals")[0].as_py(), dtype=torch.float64)
    with torch.no_grad():
        errors = ((model(torch.from_numpy(x)).reshape(-1) - torch.from_numpy(y)) ** 2).numpy()
    expected = float((errors * w).sum() / w.sum()) if weighted else float(errors.mean())
    accumulator = MetricAccumulator(torch.nn.MSELoss(), {"mse": torchmetrics.MeanSquaredError()}, torch.device("cpu"))
    accumulator.merge("mse", row.column("metric_states")[0][0].as_py())
    results = accumulator.results(totals)
    assert results["loss"] == pytest.approx(expected, rel=1e-5)
    assert float(totals[0]) == pytest.approx(w.sum() if weighted else 50, rel=1e-6)
    assert results["mse"] == pytest.approx(float(errors.mean()), rel=1e-5)  # stateful metrics see rows unweighted


def test_numeric_feature_columns_are_stacked():
    names = tuple(f"x{i}" for i in range(8))
    spec, model = _spec(columns=names)
    x = np.random.default_rng(1).normal(size=(9, 8)).astype(np.float32)
    batch = pa.RecordBatch.from_arrays([pa.array(x[:, i]) for i in range(8)], list(names))
    out = next(predict_task(spec)(iter([batch])))
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).reshape(-1).numpy()
    np.testing.assert_allclose(out.column("prediction").to_numpy(), expected, rtol=1e-6)
    assert out.schema.names == [*names, "prediction"]


class _Bag(torch.nn.Module):
    """Sums an id's embedding, the mean of a ragged token array's embeddings, and a byte image."""

    def __init__(self):
        super().__init__()
        self.ids = torch.nn.Embedding(100, 1)
        self.tokens = torch.nn.Embedding(10, 1, padding_idx=0)

    def forward(self, user, tokens, image):
        return self.ids(user % 100) + self.tokens(tokens).sum(1) + image.float().mean(dim=(1, 2, 3)).unsqueeze(1)


def test_typed_inputs_are_scored_each_with_its_type_ragged_ones_padded_per_forward_pass():
    schema = InputSchema(INPUTS_LAYOUT, (InputColumn("user", "int64", 0, "bigint"),
                                         InputColumn("tokens", "int64", 1, "array<int>"),
                                         InputColumn("image", "uint8", 1, "binary", shape=(1, 2, 2))))
    spec, model = _spec(lambda c: _Bag(), schema, ("user", "tokens", "image"))
    users = [2 ** 40 + 7, 3, 5]
    tokens = [[1, 2, 3], [4], []]
    images = [bytes([0, 1, 2, 3]), bytes([4, 4, 4, 4]), bytes([9, 9, 9, 9])]
    batch = pa.RecordBatch.from_arrays([pa.array(users), pa.array(tokens, pa.list_(pa.int64())), pa.array(images)],
                                       ["user", "tokens", "image"])
    out = next(predict_task(spec)(iter([batch])))
    with torch.no_grad():
        expected = [float(model(torch.tensor([u]), torch.tensor([t or [0]]),
                                torch.tensor(list(i), dtype=torch.uint8).reshape(1, 1, 2, 2)))
                    for u, t, i in zip(users, tokens, images)]
    np.testing.assert_allclose(out.column("prediction").to_numpy(), expected, rtol=1e-6)


class PairModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x):
        return {"prediction": self.linear(x)}


def test_transform_and_evaluate_name_the_model_or_metric_that_returns_the_wrong_kind():
    from spark_torch_est.errors import UserCodeError

    batch, _, _ = _table()
    spec, _ = _spec(model_creator=lambda config: PairModel())
    with pytest.raises(UserCodeError, match=r"the model's forward \(PairModel\) returned a dict with keys "
                                            r"'prediction'; expected one torch.Tensor"):
        list(predict_task(spec)(iter([batch])))
    spec, _ = _spec(label_col="y")
    creators = cloudpickle.loads(spec.creators)
    creators.metrics = {"both": lambda outputs, labels: {"mae": 1.0, "mse": 2.0}}
    spec = dataclasses.replace(spec, creators=cloudpickle.dumps(creators))
    with pytest.raises(UserCodeError, match="metric 'both' returned a dict with keys 'mae', 'mse'; expected"):
        list(evaluate_task(spec)(iter([batch])))
