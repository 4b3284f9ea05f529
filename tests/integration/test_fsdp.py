"""strategy="fsdp" on local[2]: sharded training and checkpoints, resume, relaunch, the
gathered model, and the driver's checks before any job."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F

from spark_torch_est import Hook, TorchModel
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.storage import CheckpointDir
from tests.helpers import CrashOnce, estimator, sgd, spark_jobs_started

pytestmark = pytest.mark.spark


class ShardSizes(Hook):
    """Rank 0's share of the parameters and of the optimizer state, seen from a hook."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}

    def after_train_epoch(self, rank, model, optimizer):
        if rank != 0:
            return
        self.sizes = {
            "params": sum(p.numel() for p in model.parameters()),
            "local_params": sum(p.to_local().numel() for p in model.parameters()),
            "local_moments": sum(v.to_local().numel() for s in optimizer.state.values() for k, v in s.items()
                                 if k == "exp_avg"),
        }

    def state_dict(self):
        return dict(self.sizes)

    def load_state_dict(self, state):
        self.sizes = dict(state)


def _fsdp(ckpt, **params):
    return estimator(**{"seed": 5, "strategy": "fsdp", "checkpointDir": str(ckpt), "timeout": 120.0,
                        "config": {"dropout": 0.2, "lr": 0.01, "width": 64}, **params})


@pytest.fixture(scope="module")
def whole(spark, linear_df, tmp_path_factory):
    """Four epochs of "fsdp" in one fit, with the ShardSizes hook."""
    ckpt = tmp_path_factory.mktemp("fsdp-whole")
    est = _fsdp(ckpt, hooks={"sizes": ShardSizes()})
    model = est.fit(linear_df)
    return est, model, ckpt


def test_two_plus_two_epochs_equal_four_bitwise(spark, linear_df, tmp_path, whole):
    est = _fsdp(tmp_path, hooks={"sizes": ShardSizes()})
    est.fit(linear_df, duration="2ep")
    est.fit(linear_df, duration="2ep")
    for key, value in whole[0].checkpoint.model_state.items():
        assert torch.equal(value, est.checkpoint.model_state[key]), key
    assert [e["epoch"] for e in est.history] == [1, 2, 3, 4]


def test_each_rank_holds_about_half_of_the_parameters_and_optimizer_state(whole):
    est, _, ckpt = whole
    sizes = est.hooks["sizes"].sizes
    assert sizes["local_params"] < 0.6 * sizes["params"]  # FSDP2 splits each tensor on dim 0
    assert sizes["local_moments"] == sizes["local_params"]  # Adam's moments are sharded like the weights
    folder = est.checkpoint.sharded["url"]
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its part
    assert not est.checkpoint.optimizer_state  # the driver holds no optimizer bytes


def test_fsdp_and_ddp_agree_after_an_epoch_of_sgd(spark, linear_df, tmp_path):
    settings = dict(seed=5, optimizer=sgd, scheduler=None, config={"dropout": 0.0, "lr": 0.05}, maxEpochs=1)
    ddp = estimator(**settings).fit(linear_df)
    fsdp = estimator(**settings, strategy="fsdp", checkpointDir=str(tmp_path)).fit(linear_df)
    for key, value in ddp.checkpoint.model_state.items():
        torch.testing.assert_close(fsdp.checkpoint.model_state[key], value, rtol=1e-5, atol=1e-6)


def test_a_run_saved_with_two_ranks_resumes_with_one(spark, linear_df, tmp_path):
    est = _fsdp(tmp_path)
    est.fit(linear_df, duration="2ep")
    est.setNumWorkers(1)
    est.fit(linear_df, duration="1ep")
    assert [e["epoch"] for e in est.history] == [1, 2, 3]
    assert est.history[2]["train_loss"] < est.history[0]["train_loss"]
    assert sorted(os.listdir(est.checkpoint.sharded["url"])) == [".metadata", "__0_0.distcp"]


def test_a_relaunch_after_a_killed_rank_resumes_from_the_sharded_checkpoint(spark, linear_df, tmp_path, caplog,
                                                                            whole):
    crashing = _fsdp(tmp_path, hooks={"sizes": ShardSizes(), "crash": CrashOnce(str(tmp_path / "crashed"))},
                     maxRetries=1)
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        crashing.fit(linear_df)
    resumed = [r.getMessage() for r in caplog.records if "the relaunch resumes from" in r.getMessage()]
    assert (tmp_path / "crashed").exists() and len(resumed) == 1 and "epoch=2" in resumed[0]
    for key, value in whole[0].checkpoint.model_state.items():
        assert torch.equal(value, crashing.checkpoint.model_state[key]), key


def test_the_fitted_model_is_the_gathered_full_model(spark, linear_df, linear_data, tmp_path, whole):
    _, model, _ = whole
    x = linear_data[0][:50]
    with torch.no_grad():
        expected = model.torch_model()(torch.from_numpy(x)).reshape(-1).numpy()
    rows = model.transform(linear_df.limit(50)).select("prediction").collect()
    np.testing.assert_allclose([r.prediction for r in rows], expected, rtol=1e-5, atol=1e-6)
    model.save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    again = loaded.transform(linear_df.limit(50)).select("prediction").collect()
    assert [r.prediction for r in again] == [r.prediction for r in rows]
    assert model.evaluate(linear_df)["loss"] == pytest.approx(loaded.evaluate(linear_df)["loss"])


def _custom_step(model, batch, loss_fn, optimizer):
    inputs, labels = batch
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss


class TrainStep(Hook):
    def train_step(self, model, batch, loss_fn, optimizer):
        return _custom_step(model, batch, loss_fn, optimizer)


def test_validation_and_train_step_work_under_fsdp(spark, linear_df, tmp_path):
    df = linear_df.withColumn("is_val", F.rand(3) < 0.13)  # uneven validation rows per rank
    est = _fsdp(tmp_path, hooks=[TrainStep()], validationIndicatorCol="is_val", maxEpochs=2)
    est.fit(df)
    assert all(np.isfinite(e["val_loss"]) for e in est.history)
    assert est.history[1]["train_loss"] < est.history[0]["train_loss"]


@pytest.mark.parametrize("params, message", [
    ({"checkpointDir": None}, 'strategy="fsdp" writes sharded checkpoints.*checkpointDir=None'),
    ({"shardModules": ["Block"]}, r"shardModules=\['Block'\]: no submodule of Sequential is a 'Block'"),
    ({"model": lambda config: torch.nn.Identity()}, "Identity has none"),
    ({"strategy": "zero3"}, "strategy must be one of 'ddp', 'fsdp', got 'zero3'"),
])
def test_bad_settings_fail_before_any_job(spark, linear_df, tmp_path, params, message):
    est = _fsdp(tmp_path, **params)
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match=message):
        est.fit(linear_df)
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None


def test_switching_strategy_within_a_run_is_refused(spark, linear_df, tmp_path, whole):
    est = whole[0].copy()
    est._checkpoint = whole[0].checkpoint  # the run as it stands
    est.setStrategy("ddp")
    with pytest.raises(InvalidInputError, match="strategy changed from 'fsdp' to 'ddp'"):
        est.fit(linear_df, duration="1ep")
    assert CheckpointDir(str(whole[2]), run_id=whole[0].checkpoint.run_id).newest() is not None
