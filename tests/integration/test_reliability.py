"""Failures, timeouts and the driver's live view on local[2]."""

from __future__ import annotations

import logging
import os
import re
import time

import pytest
import torch

from spark_torch_est import Hook
from spark_torch_est.cluster.launcher import STAGING
from spark_torch_est.core.running import PROGRESS_LOGGER
from spark_torch_est.errors import TrainingFailedError
from tests.helpers import CrashOnce, estimator, spark_jobs_started

pytestmark = pytest.mark.spark


#: This module's estimator: tests.helpers.estimator with these settings.
SETTINGS = {"seed": 5}




def test_a_crashed_rank_is_relaunched_from_the_newest_checkpoint(spark, linear_df, tmp_path, caplog):
    clean = estimator(SETTINGS)
    clean.fit(linear_df)
    crashing = estimator(SETTINGS, hooks=[CrashOnce(str(tmp_path / "crashed"))], checkpointDir=str(tmp_path / "ckpt"),
                          maxRetries=1)
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        crashing.fit(linear_df)

    assert (tmp_path / "crashed").exists()
    relaunches = [r.getMessage() for r in caplog.records if "relaunching training" in r.getMessage()]
    resumed = [r.getMessage() for r in caplog.records if "the relaunch resumes from" in r.getMessage()]
    assert len(relaunches) == 1 and len(resumed) == 1 and "epoch=2" in resumed[0]
    for key, value in clean.checkpoint.model_state.items():
        assert torch.equal(value, crashing.checkpoint.model_state[key]), key
    assert [e["epoch"] for e in crashing.history] == [1, 2, 3, 4]


def test_without_retries_a_crash_fails_keeps_the_run_and_names_the_checkpoint_to_continue_from(
        spark, linear_df, tmp_path):
    est = estimator(SETTINGS, hooks=[CrashOnce(str(tmp_path / "crashed"))], maxRetries=0,
                    checkpointDir=str(tmp_path / "ck"))
    est.fit(linear_df, duration="1ep")
    before = est.checkpoint
    with pytest.raises(TrainingFailedError) as error:
        est.fit(linear_df)  # rank 1 dies in epoch 3, after this fit wrote epoch 2's checkpoint
    assert error.value.retryable
    assert est.checkpoint is before
    hint = re.search(r"this fit wrote checkpoints to checkpointDir, the newest at epoch 2, global step \d+: continue "
                     r"from it with est\.fit\(df, resume_from='([^']+)'\)", str(error.value))
    assert hint, str(error.value)
    est.fit(linear_df, resume_from=hint.group(1))
    assert [e["epoch"] for e in est.history] == [1, 2, 3, 4]


class HangOnRank1(Hook):
    def after_train_iter(self, rank, global_step):
        if rank == 1 and global_step == 3:
            time.sleep(3600)


@pytest.mark.slow  # waits out the ranks' timeout: about 17 s
def test_a_hung_rank_fails_within_the_timeout(spark, linear_df):
    est = estimator(SETTINGS, hooks=[HangOnRank1()], timeout=10.0, maxRetries=0)
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as error:
        est.fit(linear_df)
    elapsed = time.monotonic() - started
    assert elapsed < 60, elapsed
    assert error.value.rank == 0 and error.value.retryable
    est2 = estimator(SETTINGS, maxEpochs=1)
    est2.fit(linear_df)  # the session is fine afterwards
    assert est2.progress.epoch == 1


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen = []

    def emit(self, record):
        self.seen.append((time.monotonic(), record))


class Steady(Hook):
    """Makes each step take at least 3 ms, so a fit lasts long enough to report several times."""

    def after_train_iter(self):
        time.sleep(0.003)


def test_progress_streams_to_the_driver_while_the_fit_runs(spark, linear_df):
    handler = Records()
    progress_logger = logging.getLogger("spark_torch_est.progress")
    progress_logger.addHandler(handler)
    old_level = progress_logger.level
    progress_logger.setLevel(logging.DEBUG)
    try:
        est = estimator(SETTINGS, batchSize=8, maxEpochs=3, hooks=[Steady()])
        est.fit(linear_df)
        returned = time.monotonic()
    finally:
        progress_logger.removeHandler(handler)
        progress_logger.setLevel(old_level)
    steps = [r.progress for _, r in handler.seen if hasattr(r, "progress")]
    assert len(steps) >= 3
    assert [s["global_step"] for s in steps] == sorted(s["global_step"] for s in steps)
    assert all(s["loss"] > 0 and s["steps_per_epoch"] == est.progress.global_step // 3 for s in steps)
    assert returned - handler.seen[0][0] > 0.5  # the first arrived well before fit returned
    epochs = [r.getMessage() for _, r in handler.seen if r.getMessage().startswith("epoch ")]
    assert [m.split(":")[0] for m in epochs] == ["epoch 1", "epoch 2", "epoch 3"]


class WarnOnRank1(Hook):
    def before_run(self, rank):
        if rank == 1:
            logging.getLogger("user.code").warning("rank one says hello")


def test_worker_warnings_reach_the_driver_with_their_rank(spark, linear_df, caplog):
    with caplog.at_level(logging.WARNING, logger="spark_torch_est.worker"):
        estimator(SETTINGS, hooks=[WarnOnRank1()], maxEpochs=1).fit(linear_df)
    assert any(r.getMessage() == "[rank 1] user.code: rank one says hello" for r in caplog.records)


class ExitBeforeForward(Hook):
    """Hard-exits rank 1 just before its 3rd forward pass, the first time only: rank 0 is
    then inside DDP's forward (broadcasting BatchNorm buffers) when its peer is gone."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def before_train_iter(self, rank, global_step):
        if rank == 1 and global_step == 2 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(3)


def _batch_norm_mlp(config):
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 1))


def test_a_peer_dying_while_the_survivor_is_in_forward_is_relaunched(spark, linear_df, tmp_path, caplog):
    est = estimator(SETTINGS, model=_batch_norm_mlp, hooks=[ExitBeforeForward(str(tmp_path / "exited"))], maxEpochs=2,
                     maxRetries=1)
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        est.fit(linear_df)
    assert (tmp_path / "exited").exists() and est.progress.epoch == 2
    assert any("relaunching training (1 of 1)" in r.getMessage() for r in caplog.records)


def test_a_loss_that_is_not_one_value_is_not_relaunched(spark, linear_df, caplog):
    est = estimator(SETTINGS, loss=lambda outputs, labels: (outputs - labels) ** 2, maxRetries=1)
    with caplog.at_level(logging.INFO, logger="spark_torch_est"), pytest.raises(TrainingFailedError) as error:
        est.fit(linear_df)
    assert not error.value.retryable and "holding one value" in str(error.value)
    assert not any("relaunching training" in r.getMessage() for r in caplog.records)
    assert any("not one a relaunch can fix" in r.getMessage() for r in caplog.records)


@pytest.mark.compat  # Spark 3.5 and 4 word a failed task differently
@pytest.mark.parametrize("partitions", [3, 2], ids=["staged first", "through the shuffle, as on several hosts"])
def test_a_dataframe_whose_own_function_raises_fails_at_once_naming_it(spark, linear_df, partitions, caplog,
                                                                       monkeypatch):
    """A user-defined function of the cached DataFrame raises on some rows: in the staging
    job (3 partitions for 2 ranks, one host), or in the shuffle before the ranks' tasks (2
    partitions, as where the executors run on several hosts and nothing is staged), the
    fit fails once, in one Spark job, with that error: not relaunched, not read again
    through Spark's shuffle. The progress's last phase is the one that failed."""
    from pyspark.sql import functions as F

    from spark_torch_est.core import jvm

    @F.udf("double")
    def refuse_large(label):
        if label > 1.5:
            raise ValueError(f"this function refuses the label {label:.3f}")
        return label

    df = linear_df.repartition(partitions).select("features", refuse_large("label").alias("label")).cache()
    if partitions == 2:
        monkeypatch.setattr(jvm, "one_host", lambda session: False)
    est = estimator(SETTINGS, maxRetries=2)
    first = spark_jobs_started(spark)
    with caplog.at_level(logging.INFO, logger="spark_torch_est"), pytest.raises(TrainingFailedError) as error:
        est.fit(df)
    tracker = spark.sparkContext.statusTracker()
    failed = [info for job in range(first, spark_jobs_started(spark))
              if (info := tracker.getJobInfo(job)).status == "FAILED"]  # adaptive execution runs the shuffle's own
    assert len(failed) == 1  # the staging job over the 3 partitions (its last stage), or the 2 ranks' job
    assert tracker.getStageInfo(max(failed[0].stageIds)).numTasks == partitions
    df.unpersist()
    assert not error.value.retryable
    assert error.value.message.startswith("the training DataFrame's own code failed while Spark computed its rows")
    assert "ValueError: this function refuses the label" in error.value.message
    assert "in refuse_large" in str(error.value)  # the function's own frame
    said = [r.getMessage() for r in caplog.records]
    assert not any("relaunching training" in m or "staging them failed" in m for m in said), said
    shown = [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER and r.getMessage().endswith(" ...")]
    assert shown[-1].startswith(STAGING if partitions == 3 else "launching 2 ranks"), shown
    assert est.checkpoint is None


class _RefusesLargeWhenScoring(torch.nn.Module):
    """A linear model whose predictions refuse features beyond 3 (it trains on any)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and bool((x.abs() > 3).any()):
            raise ValueError("this model refuses features beyond 3")
        return self.linear(x)


@pytest.mark.compat  # Spark 3.5 and 4 word a failed task differently
def test_a_torch_models_predictions_failing_in_the_dataframe_fail_the_fit_at_once_naming_the_dataframe(
        spark, linear_df, caplog):
    """The training DataFrame holds another model's predictions (stacked models), and that
    model raises on some rows: the error is the DataFrame's, not this package's training
    job's, so the fit fails at once instead of relaunching into the same error. The cached
    frame shuffles, so describing its cache computes it (adaptive execution runs the
    shuffle's map stage): that one job fails the fit, and no other meets the error again
    (on Spark 3.5.0 the next job over that cache would hang)."""
    from pyspark.sql import functions as F

    first = estimator(SETTINGS, model=lambda config: _RefusesLargeWhenScoring(), scheduler=None, maxEpochs=1)
    stacked = first.fit(linear_df).transform(linear_df).select("features", F.col("prediction").alias("label"))
    df = stacked.repartition(3).cache()
    est = estimator(SETTINGS, maxRetries=2)
    started = spark_jobs_started(spark)
    with caplog.at_level(logging.INFO, logger="spark_torch_est"), pytest.raises(TrainingFailedError) as error:
        est.fit(df)
    tracker = spark.sparkContext.statusTracker()
    jobs = [tracker.getJobInfo(job).status for job in range(started, spark_jobs_started(spark))]
    df.unpersist()
    assert jobs.count("FAILED") == 1 and "SUCCEEDED" not in jobs, jobs
    assert not error.value.retryable
    assert error.value.message.startswith("the training DataFrame's own code failed while Spark computed its rows (a "
                                          "TorchModel's transform in it)"), error.value.message
    assert "ValueError: this model refuses features beyond 3" in error.value.message
    assert "in forward" in str(error.value)  # the model's own frame
    assert not any("relaunching training" in r.getMessage() for r in caplog.records)
    assert est.checkpoint is None
