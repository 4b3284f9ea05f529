"""Multi-fit semantics (docs/multi-fit.md) on local[2] with 2 DDP ranks."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from spark_torch_est import Checkpoint, Logger, SetHyperparameters, TorchEstimator, TorchModel
from spark_torch_est.errors import IncompatibleCheckpointError, InvalidInputError, TrainingCompleteError
from tests.helpers import estimator, flat_weights, linear_estimator, sgd, spark_jobs_started

pytestmark = pytest.mark.spark


def _assert_same_weights(a, b) -> None:
    assert a.checkpoint.model_state.keys() == b.checkpoint.model_state.keys()
    np.testing.assert_array_equal(flat_weights(a), flat_weights(b))


@pytest.mark.compat
def test_two_plus_two_epochs_is_bitwise_four(spark, linear_df):
    whole = estimator()
    whole.fit(linear_df, duration="4ep")
    split = estimator()
    split.fit(linear_df, duration="2ep")
    split.fit(linear_df, duration="2ep")
    _assert_same_weights(whole, split)
    assert split.progress == whole.progress
    assert [e["epoch"] for e in split.history] == [1, 2, 3, 4]
    np.testing.assert_allclose([e["train_loss"] for e in split.history],
                               [e["train_loss"] for e in whole.history], rtol=1e-9)


@pytest.mark.compat
def test_batch_durations_ending_mid_epoch_resume_exactly(spark, linear_df):
    whole = estimator(maxEpochs=2)
    whole.fit(linear_df)
    split = estimator(maxEpochs=2)
    split.fit(linear_df, duration="5ba")
    assert split.progress.global_step == 5 and split.progress.batch_in_epoch == 5
    split.fit(linear_df, duration="10ba")
    split.fit(linear_df)
    _assert_same_weights(whole, split)
    assert split.progress == whole.progress


def test_durations_cap_at_max_epochs_and_a_complete_run_refuses_before_any_job(spark, linear_df):
    est = estimator(maxEpochs=3)
    est.fit(linear_df, duration="2ep")
    est.fit(linear_df, duration="5ep")
    assert est.progress.epoch == 3 and len(est.history) == 3
    jobs, started = spark_jobs_started(spark), time.monotonic()
    with pytest.raises(TrainingCompleteError, match="maxEpochs=3.*reset"):
        est.fit(linear_df, duration="1ep")
    assert spark_jobs_started(spark) == jobs and time.monotonic() - started < 2
    est.setMaxEpochs(4)
    est.fit(linear_df)
    assert est.progress.epoch == 4


def test_reset_and_copy_start_new_runs(spark, linear_df):
    est = estimator(maxEpochs=1)
    est.fit(linear_df)
    first = est.checkpoint
    copied = est.copy()
    assert copied.checkpoint is None and copied.progress.global_step == 0
    copied.fit(linear_df)
    assert est.checkpoint is first  # the copy's run is its own
    _assert_same_weights(est, copied)  # same seed, same data: same first epoch
    est.reset()
    assert est.checkpoint is None and est.history == []
    est.fit(linear_df)
    _assert_same_weights(est, copied)


@pytest.mark.compat
def test_resume_from_a_saved_model_in_a_freshestimator(spark, linear_df, tmp_path):
    whole = estimator(maxEpochs=3)
    whole.fit(linear_df)
    first = estimator(maxEpochs=3)
    model = first.fit(linear_df, duration="1ep")
    model.save(str(tmp_path / "model"))

    fresh = estimator(maxEpochs=3)
    fresh.fit(linear_df, resume_from=TorchModel.load(str(tmp_path / "model")))
    _assert_same_weights(whole, fresh)
    assert fresh.progress == whole.progress

    model.checkpoint.save(str(tmp_path / "ckpt.pt"))
    from_path = estimator(maxEpochs=3)
    from_path.fit(linear_df, resume_from=str(tmp_path / "ckpt.pt"))
    _assert_same_weights(whole, from_path)


def test_two_continuations_of_one_saved_model_into_one_folder_do_not_overwrite_each_other(spark, linear_df, tmp_path):
    from pyspark.sql import functions as F

    folder = tmp_path / "ckpt"
    estimator(maxEpochs=3, checkpointDir=str(folder)).fit(linear_df, duration="1ep").save(str(tmp_path / "model"))
    saved = TorchModel.load(str(tmp_path / "model")).checkpoint
    first = estimator(maxEpochs=3, checkpointDir=str(folder))
    first.fit(linear_df, resume_from=TorchModel.load(str(tmp_path / "model")), duration="1ep")
    written = {p.name: p.read_bytes() for p in folder.glob("ckpt-*.pt")}
    second = estimator(maxEpochs=3, checkpointDir=str(folder))
    second.fit(linear_df.withColumn("label", F.col("label") * 2.0),
               resume_from=TorchModel.load(str(tmp_path / "model")), duration="1ep")
    assert {name: (folder / name).read_bytes() for name in written} == written  # the first one's files, untouched
    runs = {saved.run_id, first.checkpoint.run_id, second.checkpoint.run_id}
    assert len(runs) == 3  # two branches of the saved run, each with its own files
    for est in (first, second):
        parent = est.checkpoint.parent
        assert (parent.run_id, parent.global_step) == (saved.run_id, saved.progress.global_step)
        (own,) = folder.glob(f"ckpt-{est.checkpoint.run_id[:12]}-*.pt")  # its epoch 2, under its own name
        on_disk = Checkpoint.load(str(own)).model_state
        assert all(torch.equal(value, on_disk[key]) for key, value in est.checkpoint.model_state.items())
    assert first.history[1]["branch_of"] == second.history[1]["branch_of"] == (
        f"{saved.run_id[:12]}@{saved.progress.global_step}")


def test_two_estimators_loaded_from_one_save_and_fitted_at_once_into_one_folder_get_their_own_runs(
        spark, linear_df, tmp_path):
    """Both copies would continue the saved run: one claims its next point in the folder (an
    atomic claim, not a listing), the other branches; each file holds its own run's weights."""
    import threading

    from pyspark.sql import functions as F

    folder = tmp_path / "ckpt"
    saved = linear_estimator(maxEpochs=3, numWorkers=1, checkpointDir=str(folder))
    saved.fit(linear_df, duration="1ep")
    saved.save(str(tmp_path / "est"))
    copies = [TorchEstimator.load(str(tmp_path / "est")) for _ in range(2)]
    frames = [linear_df, linear_df.withColumn("label", F.col("label") * 2.0)]  # two runs, two sets of weights
    together, errors = threading.Barrier(2), []

    def fit(est: TorchEstimator, frame) -> None:
        try:
            together.wait(timeout=60)
            est.fit(frame, duration="1ep")
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=fit, args=pair) for pair in zip(copies, frames)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors
    runs = [est.checkpoint.run_id for est in copies]
    assert len(set(runs)) == 2 and saved.checkpoint.run_id in runs
    for est in copies:
        (own,) = folder.glob(f"ckpt-{est.checkpoint.run_id[:12]}-ep000002-*.pt")
        on_disk = Checkpoint.load(str(own)).model_state
        assert all(torch.equal(value, on_disk[key]) for key, value in est.checkpoint.model_state.items())


def test_a_fit_from_an_earlier_point_of_its_own_run_branches_and_from_its_newest_continues(spark, linear_df):
    est = estimator(maxEpochs=3)
    earlier = est.fit(linear_df, duration="1ep")
    run = est.checkpoint.run_id
    est.fit(linear_df, resume_from=est.checkpoint, duration="1ep")  # its newest point: the same run
    assert est.checkpoint.run_id == run and est.checkpoint.parent is None
    est.fit(linear_df, resume_from=earlier, duration="1ep")  # an earlier point: a branch
    assert est.checkpoint.run_id != run and est.checkpoint.parent.run_id == run
    assert [e["epoch"] for e in est.history] == [1, 2] and est.history[1]["branch_of"].startswith(run[:12])


def test_resume_into_a_different_model_names_the_parameters(spark, linear_df):
    est = estimator(maxEpochs=2)
    est.fit(linear_df, duration="1ep")
    other = estimator(maxEpochs=2, config={"width": 32})
    jobs = spark_jobs_started(spark)
    with pytest.raises(IncompatibleCheckpointError, match=r"0.weight \[16, 8\] -> \[32, 8\]"):
        other.fit(linear_df, resume_from=est.checkpoint)
    assert spark_jobs_started(spark) == jobs
    assert other.checkpoint is None


def test_fine_tune_on_new_data_with_a_new_learning_rate(spark, linear_df):
    from pyspark.sql import functions as F

    tune = SetHyperparameters()
    est = estimator(maxEpochs=3, scheduler=None, optimizer=sgd, config={"lr": 0.05}, hooks=[tune])
    est.fit(linear_df, duration="1ep")
    shifted = linear_df.withColumn("label", F.col("label") + 1.0)

    tune.values = {"lr": 0.0}  # a zero learning rate: the second fit must not move the weights
    before = {k: v.clone() for k, v in est.checkpoint.model_state.items()}
    est.fit(shifted, duration="1ep")
    for key, value in est.checkpoint.model_state.items():
        assert torch.equal(value, before[key])
    assert est.checkpoint.optimizer_state["param_groups"][0]["lr"] == 0.0

    tune.values = {"lr": 0.05}
    est.fit(shifted)
    assert est.progress.epoch == 3
    assert est.history[-1]["train_loss"] < est.history[-2]["train_loss"]


def test_periodic_checkpoints_are_written_atomically_with_a_latest_pointer(spark, linear_df, tmp_path):
    directory = tmp_path / "ckpts"
    est = estimator(maxEpochs=4, checkpointDir=str(directory), checkpointInterval="1ep")
    est.fit(linear_df)
    per_epoch = est.progress.global_step // 4
    names = sorted(p.name for p in directory.iterdir())
    run = est.checkpoint.run_id[:12]
    assert names == [f"ckpt-{run}-ep{e:06d}-ba{e * per_epoch:012d}.pt" for e in (2, 3, 4)] + ["latest"]
    latest = Checkpoint.load(str(directory / (directory / "latest").read_text()))
    assert latest.progress == est.progress
    resumed = estimator(maxEpochs=5)
    resumed.fit(linear_df, resume_from=str(directory))  # a directory: where its `latest` points
    assert resumed.progress.epoch == 5 and resumed.history[:4] == est.history


def test_exact_resume_also_when_the_input_is_reshuffled_into_ranks(spark, linear_data):
    x, y, _, _ = linear_data
    rows = spark.sparkContext.parallelize([(r.tolist(), float(t)) for r, t in zip(x, y)], 3)
    df = spark.createDataFrame(rows, "features array<double>, label double")  # 3 partitions -> 2 ranks
    whole = estimator(maxEpochs=2)
    whole.fit(df)
    split = estimator(maxEpochs=2)
    split.fit(df, duration="1ep")
    split.fit(df)
    _assert_same_weights(whole, split)


def _lazy_model(config):
    return torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.LazyLinear(1))


def test_a_lazy_model_continues_its_run_and_resumes_exactly(spark, linear_df):
    """Lazy modules take their shapes at the first forward: a second fit and resume_from
    load the state into an uninitialized model."""
    whole = estimator(model=_lazy_model, scheduler=None, maxEpochs=2)
    whole.fit(linear_df)
    split = estimator(model=_lazy_model, scheduler=None, maxEpochs=2)
    first = split.fit(linear_df, duration="1ep")
    split.fit(linear_df)
    _assert_same_weights(whole, split)
    resumed = estimator(model=_lazy_model, scheduler=None, maxEpochs=2)
    resumed.fit(linear_df, resume_from=first)
    _assert_same_weights(whole, resumed)


class FitAgainWhileFitting(Logger):
    """Calls ``fit`` on the estimator whose fit is starting, then fits a copy of it (from
    the logger's own thread, while the first fit waits for it); keeps what the second fit
    raised and the copy's progress."""

    event_timeout_s = 300.0

    def __init__(self, estimator: TorchEstimator, frame) -> None:
        self.work = (estimator, frame)
        self.refusal: Exception | None = None
        self.copy_progress = None

    def on_fit_start(self):
        if self.work is None:  # only the first fit's start tries
            return
        (estimator, frame), self.work = self.work, None
        try:
            estimator.fit(frame)
        except InvalidInputError as error:
            self.refusal = error
        self.copy_progress = estimator.copy().fit(frame, duration="1ep").checkpoint.progress


def test_a_second_fit_of_an_estimator_that_is_fitting_is_refused_and_the_first_trains_on(spark, linear_df):
    est = linear_estimator(maxEpochs=2, numWorkers=1)
    again = FitAgainWhileFitting(est, linear_df)
    est.setLoggers([again]).fit(linear_df)

    assert again.refusal is not None, "the second fit ran alongside the first"
    assert "already fitting" in str(again.refusal) and "est.copy()" in str(again.refusal)
    assert again.copy_progress.epoch == 1, "a copy is another run: it fits while the original does"
    assert est.progress.epoch == 2 and [entry["epoch"] for entry in est.history] == [1, 2]
    est.setMaxEpochs(3).fit(linear_df)  # once the first fit returned, the run goes on
    assert est.progress.epoch == 3


def test_a_new_driver_on_a_checkpoint_dir_that_holds_a_run_is_told_and_resume_from_the_dir_continues_it(
        spark, linear_df, tmp_path, caplog):
    """A new driver whose estimator names the same checkpointDir but no resume_from trained
    from epoch 0 with no word that the folder held a run at epoch 2 of 6."""
    import logging

    folder = str(tmp_path / "ckpt")
    killed = estimator(maxEpochs=6, checkpointDir=folder)  # the first driver, 2 epochs done
    killed.fit(linear_df, duration="2ep")
    run = killed.checkpoint.run_id
    continued = estimator(maxEpochs=6, checkpointDir=folder)  # the new driver
    continued.fit(linear_df, resume_from=folder, duration="1ep")  # the newest run in the folder, from epoch 2
    parent = continued.checkpoint.parent  # another estimator's run: continued as its branch (docs/multi-fit.md)
    assert continued.progress.epoch == 3 and (parent.run_id, parent.global_step) == (run, killed.progress.global_step)
    run = continued.checkpoint.run_id
    with caplog.at_level(logging.WARNING):
        fresh = estimator(maxEpochs=6, checkpointDir=folder)
        fresh.fit(linear_df, duration="1ep")
    notices = [r.getMessage() for r in caplog.records if "already holds a run" in r.getMessage()]
    assert len(notices) == 1, caplog.text
    assert f"ckpt-{run[:12]}-ep000003-" in notices[0] and "at epoch 3 of maxEpochs=6" in notices[0]
    assert f"resume_from={folder!r}" in notices[0]
    assert fresh.checkpoint.run_id != run and fresh.progress.epoch == 1
