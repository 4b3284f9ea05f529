"""strategy="fsdp" on local[2]: sharded training and checkpoints, resume, relaunch, the
gathered model, and the driver's checks before any job."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F

from spark_torch_est import Hook, TorchModel
from spark_torch_est.checkpoints.storage import CheckpointDir
from spark_torch_est.core.support import FSDP_CPU, installed
from spark_torch_est.errors import IncompatibleCheckpointError, InvalidInputError
from tests.helpers import CrashOnce, estimator, sgd, spark_jobs_started

pytestmark = [pytest.mark.spark,
              pytest.mark.skipif(installed("torch") < FSDP_CPU.needs, reason="FSDP2 on CPU needs torch >= 2.7 "
                                 "(refused: test_support.py)")]
SCRIPTS = Path(__file__).parent / "scripts"


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


@pytest.mark.compat
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


@pytest.mark.compat
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


class Recommender(torch.nn.Module):
    """Typed inputs: ``model(user, item, dense)`` with int64 ids into two embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.users, self.items = torch.nn.Embedding(50, 8), torch.nn.Embedding(40, 8)
        self.dense = torch.nn.Linear(3, 8)
        self.head = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, user, item, dense):
        return self.head(torch.cat([self.users(user), self.items(item), self.dense(dense)], dim=1))


def _recommender_df(spark, rows: int = 1200):
    rng = np.random.default_rng(11)
    user, item = rng.integers(0, 50, rows), rng.integers(0, 40, rows)
    dense = rng.normal(size=(rows, 3)).astype(np.float32)
    label = np.sin(user / 7.0) + np.cos(item / 5.0) + dense[:, 0]  # learnable from every input
    rows = [(int(u), int(i), d.tolist(), float(y)) for u, i, d, y in zip(user, item, dense, label)]
    return spark.createDataFrame(rows, "user long, item long, dense array<float>, label double")


def test_typed_inputs_loggers_and_predict_udf_work_under_fsdp(spark, tmp_path):
    from spark_torch_est import CSVLogger

    df = _recommender_df(spark)
    est = _fsdp(tmp_path / "ckpt", model=lambda config: Recommender(), inputCols=["user", "item", "dense"],
                shardModules=["Embedding", "Sequential"], loggers=[CSVLogger(str(tmp_path / "logs"))], maxEpochs=3,
                config={"lr": 0.02})
    model = est.fit(df)
    assert est.history[-1]["train_loss"] < 0.5 * est.history[0]["train_loss"]
    [run] = os.listdir(tmp_path / "logs")
    with open(tmp_path / "logs" / run / "metrics.csv") as f:
        assert [line.split(",")[0] for line in f.read().split()[1:]] == ["1", "2", "3"]  # one row per epoch
    scored = df.limit(40).withColumn("id", F.monotonically_increasing_id())
    rows = model.transform(scored).orderBy("id").select("user", "item", "dense", "prediction").collect()
    with torch.no_grad():
        expected = model.torch_model()(torch.tensor([r.user for r in rows]), torch.tensor([r.item for r in rows]),
                                       torch.tensor([r.dense for r in rows])).reshape(-1).numpy()
    np.testing.assert_allclose([r.prediction for r in rows], expected, rtol=1e-5, atol=1e-6)
    predict = model.predict_udf()
    udf_rows = scored.withColumn("p", predict("user", "item", "dense")).orderBy("id").select("p").collect()
    assert [r.p for r in udf_rows] == [r.prediction for r in rows]


class KillDuringTheSave(Hook):
    """Hard-exits rank 1's Python worker in the middle of the sharded save after epoch
    ``epoch``, once its own part is written and before the save completes (rank 0 still
    gathers the plan and writes ``.metadata``); ``marker`` makes it happen once."""

    def __init__(self, marker: str, epoch: int = 2) -> None:
        self.marker, self.epoch = marker, epoch

    def after_train_epoch(self, rank, metrics):
        if rank != 1 or metrics["epoch"] != self.epoch or os.path.exists(self.marker):
            return
        from torch.distributed.checkpoint import FileSystemWriter

        marker, write = self.marker, FileSystemWriter.write_data

        def write_then_die(writer, plan, planner):
            write(writer, plan, planner).wait()  # this rank's .distcp is on disk
            open(marker, "w").close()
            os._exit(3)

        FileSystemWriter.write_data = write_then_die  # this worker dies with the patch


def test_a_rank_killed_during_a_sharded_save_resumes_from_the_save_before(spark, linear_df, tmp_path, caplog, whole):
    crashing = _fsdp(tmp_path, hooks={"sizes": ShardSizes(), "kill": KillDuringTheSave(str(tmp_path / "killed"))},
                     maxRetries=1)
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        crashing.fit(linear_df)
    resumed = [r.getMessage() for r in caplog.records if "the relaunch resumes from" in r.getMessage()]
    assert (tmp_path / "killed").exists() and len(resumed) == 1, resumed
    assert "epoch=1" in resumed[0]  # the unfinished save of epoch 2 is not taken
    for key, value in whole[0].checkpoint.model_state.items():
        assert torch.equal(value, crashing.checkpoint.model_state[key]), key
    assert [e["epoch"] for e in crashing.history] == [1, 2, 3, 4]


@pytest.mark.slow  # its own local[3] session in a subprocess
def test_a_run_saved_with_two_ranks_resumes_with_three(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPTS / "fsdp_reshard.py"), str(tmp_path)], capture_output=True,
                            text=True, timeout=600)
    line = next((text for text in result.stdout.splitlines() if text.startswith("RESULT ")), None)
    assert line, result.stdout[-2000:] + result.stderr[-6000:]
    found = json.loads(line[len("RESULT "):])
    assert found["same_weights"] == found["keys"]  # the 3 ranks start from exactly the weights 2 ranks saved
    assert [(e["epoch"], e["world_size"]) for e in found["history"]] == [(1, 2), (2, 2), (3, 3)]
    assert found["history"][2]["train_loss"] < found["history"][0]["train_loss"]
    assert found["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]


@pytest.mark.parametrize("settings", [
    {"precision": "bf16-mixed"},
    pytest.param({"compileModel": True}, marks=pytest.mark.slow),  # each rank compiles the model, each fit
])
def test_mixed_precision_and_compile_train_and_resume_exactly_under_fsdp(spark, linear_df, tmp_path, settings):
    whole = _fsdp(tmp_path / "whole", maxEpochs=2, **settings)
    whole.fit(linear_df)
    halves = _fsdp(tmp_path / "halves", maxEpochs=2, **settings)
    halves.fit(linear_df, duration="1ep")
    model = halves.fit(linear_df, duration="1ep")
    for key, value in whole.checkpoint.model_state.items():
        assert torch.equal(value, halves.checkpoint.model_state[key]), key
    assert halves.history[1]["train_loss"] < halves.history[0]["train_loss"]
    assert set(model.torch_model().state_dict()) == set(whole.checkpoint.model_state)  # plain keys


def _files(folder: Path) -> dict[str, bytes]:
    """Every checkpoint file under ``folder`` (not the shared ``latest`` pointer) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != "latest"}


def test_a_branch_into_the_same_checkpoint_dir_leaves_the_parents_files_and_its_next_fit_works(
        spark, linear_df, tmp_path):
    est = _fsdp(tmp_path)
    first = est.fit(linear_df, duration="1ep")
    est.fit(linear_df, duration="1ep")
    run, before = est.checkpoint.run_id, _files(tmp_path)
    shifted = linear_df.withColumn("label", F.col("label") + 1.0)
    branch = _fsdp(tmp_path).fit(shifted, resume_from=first, duration="1ep").checkpoint
    after = _files(tmp_path)
    assert {name: after.get(name) for name in before} == before  # the parent's files, byte for byte
    assert branch.run_id != run and {name.split("-")[1] for name in set(after) - set(before)} == {branch.run_id[:12]}
    est.fit(linear_df, duration="1ep")  # the parent reads its epoch-2 shards and goes on
    assert est.checkpoint.run_id == run and [e["epoch"] for e in est.history] == [1, 2, 3]
    step = first.checkpoint.progress.global_step
    assert (branch.parent.run_id, branch.parent.global_step) == (run, step)
    assert branch.history[1]["branch_of"] == f"{run[:12]}@{step}"
    assert "branch_of" not in branch.history[0]  # the parent's own epoch, as it was
    assert est.checkpoint.parent is None and all("branch_of" not in e for e in est.history)


def test_a_saved_fsdp_model_resumes_after_its_runs_checkpoint_dir_is_deleted(spark, linear_df, tmp_path, whole):
    est = _fsdp(tmp_path / "ckpt", hooks={"sizes": ShardSizes()})
    est.fit(linear_df, duration="2ep").save(str(tmp_path / "model"))
    shutil.rmtree(tmp_path / "ckpt")
    loaded = TorchModel.load(str(tmp_path / "model"))
    resumed = _fsdp(tmp_path / "other", hooks={"sizes": ShardSizes()})
    resumed.fit(linear_df, resume_from=loaded, duration="2ep")
    for key, value in whole[0].checkpoint.model_state.items():  # the same as 4 epochs in one fit
        assert torch.equal(value, resumed.checkpoint.model_state[key]), key
    assert [e["epoch"] for e in resumed.history] == [1, 2, 3, 4]
    parent = resumed.checkpoint.parent
    assert (parent.run_id, parent.global_step) == (est.checkpoint.run_id, est.checkpoint.progress.global_step)


def test_a_model_whose_sharded_state_is_gone_is_refused_before_any_job(spark, linear_df, tmp_path, caplog):
    model = _fsdp(tmp_path / "ckpt").fit(linear_df, duration="1ep")
    shutil.rmtree(tmp_path / "ckpt")  # pruned by the run's later fits, or deleted
    est = _fsdp(tmp_path / "other")

    def refused(source) -> None:
        jobs, started = spark_jobs_started(spark), time.monotonic()
        with pytest.raises(IncompatibleCheckpointError, match=r"the sharded checkpoint .*ckpt-.*\.dcp is gone "
                                                              r"\(\.metadata.*TorchModel\.save"):
            est.fit(linear_df, resume_from=source)
        assert spark_jobs_started(spark) == jobs and time.monotonic() - started < 10
        assert est.checkpoint is None

    refused(model)
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        model.save(str(tmp_path / "model"))  # still a model for inference
    assert "cannot be continued" in caplog.text
    loaded = TorchModel.load(str(tmp_path / "model"))
    refused(loaded)
    assert loaded.transform(linear_df.limit(5)).count() == 5


def test_a_resume_from_a_folder_with_a_fifo_part_or_a_crafted_metadata_ends_at_once(spark, linear_df, tmp_path):
    """A FIFO planted as a part would block a rank's read past any timeout (it hung fits for
    minutes); a crafted .metadata (its digest forged in the .pt) would run code. The first
    fails the fit at once naming the part, the second is refused before any job."""
    import hashlib

    from spark_torch_est import Checkpoint
    from spark_torch_est.errors import SparkTorchError

    est = _fsdp(tmp_path / "ckpt", timeout=30.0, maxRetries=0)
    est.fit(linear_df, duration="1ep")
    folder = Path(est.checkpoint.sharded["url"])
    os.remove(folder / "__1_0.distcp")
    os.mkfifo(folder / "__1_0.distcp")
    started = time.monotonic()
    with pytest.raises(SparkTorchError, match=r"__1_0\.distcp of the sharded checkpoint is not a regular file"):
        _fsdp(tmp_path / "other", timeout=30.0, maxRetries=0).fit(linear_df, resume_from=str(tmp_path / "ckpt"))
    assert time.monotonic() - started < 60

    marker = tmp_path / "ran"
    crafted = (b"\x80\x04\x8c\x27torch.distributed.checkpoint.filesystem\x8c\x09os.system\x93"
               + b"\x8c" + bytes([len(f"touch {marker}")]) + f"touch {marker}".encode() + b"\x85R.")
    (folder / ".metadata").write_bytes(crafted)
    digest = hashlib.sha256(crafted).hexdigest()
    (pt,) = (tmp_path / "ckpt").glob("ckpt-*.pt")
    saved = Checkpoint.load(str(pt))
    sharded = {**saved.sharded, "digest": digest, "files": {**saved.sharded["files"], ".metadata": digest}}
    Checkpoint({**saved._state, "sharded": sharded}).save(str(pt))
    jobs = spark_jobs_started(spark)
    with pytest.raises(IncompatibleCheckpointError, match=r"\.metadata refers to torch\.distributed\.checkpoint\."
                                                          r"filesystem\.os\.system"):
        _fsdp(tmp_path / "other").fit(linear_df, resume_from=str(tmp_path / "ckpt"))
    assert spark_jobs_started(spark) == jobs and not marker.exists()
