"""Changing a run between fits: every row of docs/multi-fit.md's table, honored or refused."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F

from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.errors import InvalidInputError, TrainingCompleteError
from tests.helpers import CountSteps, SeenRows, estimator, seen_rows, spark_jobs_started

pytestmark = pytest.mark.spark

ROWS = 2000


@pytest.fixture(scope="module")
def indexed_df(spark):
    """2,000 rows whose label is the row's index (every row tells which it is)."""
    x = np.random.default_rng(3).normal(size=(ROWS, 8))
    return spark.createDataFrame([(row.tolist(), float(i)) for i, row in enumerate(x)], ["features", "label"])


def test_a_new_batch_size_continues_the_epoch_from_the_same_sample(spark, indexed_df, tmp_path):
    est = estimator(batchSize=64, maxEpochs=4, hooks=[SeenRows(str(tmp_path))])
    est.fit(indexed_df, duration="10ba")
    assert (est.progress.global_step, est.progress.samples) == (10, 1280)
    est.setBatchSize(256)
    est.fit(indexed_df, duration="1ep")
    assert (est.progress.epoch, est.progress.global_step, est.progress.samples) == (1, 12, ROWS)
    assert seen_rows(tmp_path, 0) == list(range(ROWS)), "every row exactly once in the epoch"


def test_other_data_mid_epoch_continues_from_the_same_fraction_and_says_so(spark, indexed_df, caplog):
    est = estimator(batchSize=64, maxEpochs=4)
    est.fit(indexed_df, duration="10ba")                        # 1,280 of 2,000 rows: 64%
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        est.fit(indexed_df.filter("label < 1000"), duration="1ep")
    assert est.progress.epoch == 1 and est.progress.global_step == 13  # 36% of 1,000 rows: 3 steps
    assert any("continues with 1000 rows on 2 (read through Spark in its order)" in r.getMessage()
               and "same fraction (64.0%)" in r.getMessage()
               for r in caplog.records)


def test_an_epoch_placed_by_an_older_round_robin_continues_from_the_same_fraction(spark, indexed_df, caplog):
    est = estimator(batchSize=64, maxEpochs=4)
    est.fit(indexed_df, duration="10ba")
    assert est.checkpoint.data_source == "spark:positions"
    # as checkpoints written before the rows were dealt out by position say
    est._checkpoint = Checkpoint({**est.checkpoint._state, "data_source": "spark:partitions"})
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        est.fit(indexed_df, duration="1ep")
    assert est.progress.epoch == 1 and est.progress.global_step == 10 + 6  # 36% of each worker's 1,000 rows
    assert any("(read through Spark, placed as before the rows were dealt out by position) and continues" in m
               and "same fraction (64.0%)" in m for m in (r.getMessage() for r in caplog.records))


def test_fewer_workers_mid_epoch_and_at_an_epoch_end(spark, indexed_df, tmp_path, caplog):
    est = estimator(batchSize=64, maxEpochs=3, hooks=[SeenRows(str(tmp_path))])
    est.fit(indexed_df, duration="10ba")
    est.setNumWorkers(1)
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        est.fit(indexed_df, duration="1ep")
    # the run's two logical shards go on, 32 rows of each per step: the last 36% on one worker
    assert est.progress.epoch == 1 and est.progress.global_step == 10 + 12
    assert not any("same fraction" in r.getMessage() for r in caplog.records), "the epoch continues exactly"
    assert seen_rows(tmp_path, 0) == list(range(ROWS)), "every row exactly once in the epoch"
    est.fit(indexed_df, duration="1ep")
    assert est.progress.epoch == 2 and est.progress.global_step == 22 + 32
    est.setNumWorkers(2)  # and back
    est.fit(indexed_df, duration="1ep")
    assert est.progress.epoch == 3 and est.progress.global_step == 54 + 16


def test_max_epochs_below_the_run_refuses_and_above_it_continues(spark, indexed_df):
    est = estimator(maxEpochs=2)
    est.fit(indexed_df, duration="1ep")
    est.setMaxEpochs(1)
    jobs = spark_jobs_started(spark)
    with pytest.raises(TrainingCompleteError, match="maxEpochs=1"):
        est.fit(indexed_df)
    assert spark_jobs_started(spark) == jobs
    est.setMaxEpochs(3)
    est.fit(indexed_df)
    assert est.progress.epoch == 3


def test_a_new_config_is_honored_and_set_hyperparameters_too(spark, indexed_df):
    est = estimator(maxEpochs=3)
    est.fit(indexed_df, duration="1ep")
    before = {k: v.clone() for k, v in est.checkpoint.model_state.items()}
    est.setConfig({**est.getConfig(), "lr": 0.0})
    est.fit(indexed_df, duration="1ep")
    for key, value in before.items():  # Adam at lr 0 moves nothing
        assert torch.equal(value, est.checkpoint.model_state[key]), key
    assert est.checkpoint.optimizer_state["param_groups"][0]["lr"] == 0.0


def test_a_new_loss_is_used_by_the_next_fit_and_its_model(spark, indexed_df):
    est = estimator(maxEpochs=2)
    est.fit(indexed_df, duration="1ep")
    est.setLoss(torch.nn.L1Loss())
    model = est.fit(indexed_df, duration="1ep")
    scored = model.transform(indexed_df).select("label", "prediction").toPandas()
    mae = float((scored["label"] - scored["prediction"]).abs().mean())
    assert model.evaluate(indexed_df)["loss"] == pytest.approx(mae, rel=1e-4)




def test_hooks_added_and_removed_between_fits(spark, indexed_df):
    kept, added = CountSteps(), CountSteps()
    est = estimator(maxEpochs=3, hooks={"kept": kept, "gone": CountSteps()})
    est.fit(indexed_df, duration="1ep")
    steps = est.progress.global_step
    est.setHooks({"kept": kept, "added": added})
    est.fit(indexed_df, duration="1ep")
    assert est.hooks["kept"].state_dict() == {"steps": 2 * steps, "runs": 2}
    assert est.hooks["added"].state_dict() == {"steps": steps, "runs": 1}, "before_run fired; its own state"
    assert set(est.checkpoint.hook_states) == {"kept", "added"}
    est.setHooks({"kept": CountSteps()})  # a new object under a known name starts from its own state
    est.fit(indexed_df, duration="1ep")
    assert est.hooks["kept"].state_dict() == {"steps": steps, "runs": 1}


def test_a_validation_column_set_between_fits(spark, indexed_df):
    est = estimator(maxEpochs=3)
    est.fit(indexed_df, duration="1ep")
    est.setValidationIndicatorCol("is_val")
    est.fit(indexed_df.withColumn("is_val", F.col("label") % 10 == 0), duration="1ep")
    est.setValidationIndicatorCol(None)  # unset: every row trains again
    est.fit(indexed_df, duration="1ep")
    assert "val_loss" not in est.history[0] and "val_loss" in est.history[1] and "val_loss" not in est.history[2]
    assert est.progress.samples == 3 * ROWS - ROWS // 10


def test_a_new_checkpoint_dir_takes_the_runs_next_checkpoints(spark, indexed_df, tmp_path):
    est = estimator(maxEpochs=2, checkpointDir=str(tmp_path / "a"))
    est.fit(indexed_df, duration="1ep")
    est.setCheckpointDir(str(tmp_path / "b"))
    est.fit(indexed_df, duration="1ep")
    run = est.checkpoint.run_id[:12]
    assert [p.name for p in sorted((tmp_path / "a").glob("ckpt-*"))] == [f"ckpt-{run}-ep000001-ba000000000008.pt"]
    assert [p.name for p in sorted((tmp_path / "b").glob("ckpt-*"))] == [f"ckpt-{run}-ep000002-ba000000000016.pt"]


def test_a_new_seed_is_refused_mid_epoch_and_taken_at_an_epoch_end(spark, indexed_df):
    est = estimator(maxEpochs=2)
    est.fit(indexed_df, duration="3ba")
    before, jobs = est.checkpoint, spark_jobs_started(spark)
    est.setSeed(99)
    with pytest.raises(InvalidInputError, match="seed changed from 11 to 99 in the middle of epoch 1"):
        est.fit(indexed_df)
    assert est.checkpoint is before and spark_jobs_started(spark) == jobs
    est.setSeed(11)
    est.fit(indexed_df, duration="1ep")
    est.setSeed(99)
    est.fit(indexed_df)
    assert est.progress.epoch == 2 and est.checkpoint.seed == 99


@pytest.mark.slow  # two sessions of its own; tests/unit/ingest/test_canonical.py checks the same on ranks
def test_a_run_continued_mid_epoch_on_one_then_three_workers_trains_each_step_as_undisturbed():
    """On local[3] (a script of its own): numWorkers 2, then 1, then 3 between fits, the
    global batch kept at 12 rows; every global step trains the rows of an undisturbed run."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "resized_fit.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    line = next((part for part in result.stdout.splitlines() if part.startswith("RESULT ")), None)
    assert line, result.stdout[-2000:] + result.stderr[-6000:]
    found = json.loads(line[len("RESULT "):])
    whole, resized = found["whole"], found["resized"]
    assert (resized["global_step"], resized["samples"]) == (whole["global_step"], whole["samples"]) == (100, 1200)
    assert resized["steps"] == whole["steps"], "each global step trains the rows it trains undisturbed"
    for epoch in range(2):
        seen = sorted(v for step in range(50 * epoch + 1, 50 * epoch + 51) for v in resized["steps"][str(step)])
        assert seen == list(range(600)), "every row exactly once per epoch"
    for changed, undisturbed in zip(resized["history"], whole["history"]):
        assert changed["train_loss"] == pytest.approx(undisturbed["train_loss"], rel=1e-3)
    assert [e["world_size"] for e in resized["history"]] == [1, 3]
