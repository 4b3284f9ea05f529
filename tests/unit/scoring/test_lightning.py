"""evaluate() and transform of a LightningModule in a task, without Spark: its validation_step
as pl.Trainer.validate runs it, its predict_step as transform's outputs."""

from __future__ import annotations

import dataclasses
import hashlib
import io

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_torch_est.errors import InvalidInputError, UserCodeError
from spark_torch_est.scoring.inference import ScoringSpec, predict_task
from spark_torch_est.scoring.lightning import validate_task, validated
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.lightning import defines, scorer
from tests.helpers import features_schema

pl = pytest.importorskip("lightning.pytorch")


class Scored(pl.LightningModule):
    """Logs its MSE and a weighted MSE in validation; predicts through its own predict_step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.layer(x)

    def validation_step(self, batch, batch_idx):
        x, y, w = batch
        error = (self(x).squeeze(-1) - y) ** 2
        self.log("val_mse", error.mean())
        self.log("val_weighted", (w * error).sum() / w.sum())

    def predict_step(self, batch, batch_idx):
        return self(batch) * 10


def _spec(**fields) -> tuple[ScoringSpec, Scored]:
    module = Scored()
    weights = io.BytesIO()
    torch.save(module.state_dict(), weights)
    return ScoringSpec(key=hashlib.sha256(weights.getvalue()).hexdigest(), creators=cloudpickle.dumps(
        Creators(model=lambda config: Scored(), optimizer=None, loss=None)), weights=weights.getvalue(), batch_size=7,
        schema=features_schema(8).to_dict(), columns=("x",), label_col="y", weight_col="w", **fields), module.eval()


def _rows(rows: int, seed: int) -> tuple[pa.RecordBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    y = (x.sum(axis=1) + 1).astype(np.float32)
    w = rng.uniform(0.5, 2, size=rows).astype(np.float32)
    batch = pa.RecordBatch.from_arrays([pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8), pa.array(y),
                                        pa.array(w)], ["x", "y", "w"])
    return batch, torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(w)


def test_partitions_validated_apart_give_what_pl_trainer_validate_gives_for_every_row():
    spec, module = _spec()
    parts = [_rows(23, 0), _rows(50, 1)]  # of different sizes, in batches of 7 rows
    partitions = []
    for batch, *_ in parts:
        (out,) = list(validate_task(spec)(iter([batch])))
        partitions.append(out.to_pylist()[0])
    assert [p["rows"] for p in partitions] == [23, 50]
    x, y, w = (torch.cat([part[i] for part in parts]) for i in (1, 2, 3))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    (expected,) = trainer.validate(module, dataloaders=torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y, w), batch_size=7), verbose=False)
    combined = validated(partitions)
    assert set(combined) == {"val_mse", "val_weighted"}
    assert combined["val_mse"] == pytest.approx(expected["val_mse"], rel=1e-5)
    assert np.isfinite(combined["val_weighted"])  # the weight came last in the batch


def test_a_partition_without_rows_adds_nothing_not_even_a_nan():
    empty = {"rows": 0, "names": ["val_auc"], "values": [float("nan")]}  # an epoch end's metric over nothing
    full = {"rows": 5, "names": ["val_auc"], "values": [0.75]}
    assert validated([empty, full]) == {"val_auc": 0.75}


def test_no_rows_anywhere_is_a_clear_error():
    spec, _ = _spec()
    batch, *_ = _rows(0, 0)
    (out,) = list(validate_task(spec)(iter([batch])))
    with pytest.raises(InvalidInputError, match="without rows"):
        validated([out.to_pylist()[0]])


def test_transform_calls_predict_step_where_the_class_defines_it():
    spec, module = _spec(prediction_col="p")
    batch, x, _, _ = _rows(20, 2)
    (out,) = list(predict_task(spec)(iter([batch])))
    with torch.no_grad():
        np.testing.assert_allclose(out.column("p").to_numpy(), (module(x) * 10).squeeze(-1).numpy(), rtol=1e-6)
    assert defines(module, "predict_step") and defines(module, "validation_step")
    assert not defines(module, "test_step") and not defines(torch.nn.Linear(1, 1), "forward")
    assert scorer(torch.nn.Linear(1, 1))[0] == "forward" and scorer(module)[0] == "predict_step"


def test_a_predict_step_that_returns_no_tensor_is_named():
    class Dicts(Scored):
        def predict_step(self, batch, batch_idx):
            return {"y": self(batch)}

    spec, _ = _spec()
    spec = dataclasses.replace(spec, creators=cloudpickle.dumps(Creators(model=lambda config: Dicts(), optimizer=None,
                                                                         loss=None)), key="dicts")
    batch, *_ = _rows(5, 3)
    with pytest.raises(UserCodeError, match=r"the model's predict_step \(.*Dicts\) returned a dict"):
        list(predict_task(spec)(iter([batch])))
