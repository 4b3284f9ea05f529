"""The bad-input matrix: each gives a clear SparkTorchError subclass, quickly, and leaves
the estimator's run intact so that a following good fit resumes it."""

from __future__ import annotations

import io
import math
import os
import threading
import time

import pytest
import torch
from pyspark.sql import functions as F

from spark_torch_est import Hook, TorchEstimator
from spark_torch_est.errors import IncompatibleCheckpointError, InvalidInputError, SparkTorchError, TrainingFailedError
from tests.helpers import linear_estimator, linear_model, sgd, spark_jobs_started

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def trained(spark, linear_df):
    est = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), batchSize=64,
                         maxEpochs=3, numWorkers=2, showProgress=False, slotWaitTimeout=1.0, timeout=60.0)
    est.fit(linear_df, duration="1ep")
    return est


def _null_features(df):
    return df.withColumn("features", F.when(F.rand(1) < 0.01, F.lit(None)).otherwise(F.col("features")))


def _null_labels(df):
    return df.withColumn("label", F.when(F.rand(2) < 0.01, F.lit(None)).otherwise(F.col("label")))


DATA_CASES = {
    "missing label column": (lambda df: df.drop("label"), InvalidInputError, "labelCol='label': no such column", False),
    "missing features column": (lambda df: df.withColumnRenamed("features", "x"), InvalidInputError,
                                "featuresCol='features': no such column", False),
    "non-numeric label": (lambda df: df.withColumn("label", F.lit("high")), InvalidInputError, "has type string",
                          False),
    "non-numeric features": (lambda df: df.withColumn("features", F.array(F.lit("a"))), InvalidInputError,
                             "array<string>", False),
    "null feature rows": (_null_features, InvalidInputError, "null rows", True),
    "null labels": (_null_labels, InvalidInputError, "'label' has .* null values", True),
    "empty DataFrame": (lambda df: df.limit(0), InvalidInputError, "has no rows", True),
    "empty partitions": (lambda df: df.filter("label > 1e9"), InvalidInputError, "no training rows", True),
    "fewer rows than workers": (lambda df: df.limit(1), InvalidInputError, "no training rows", True),
}


@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_data(trained, spark, linear_df, case):
    transform, error_type, message, needs_job = DATA_CASES[case]
    before, jobs, started = trained.checkpoint, spark_jobs_started(spark), time.monotonic()
    with pytest.raises(error_type, match=message):
        trained.fit(transform(linear_df))
    assert time.monotonic() - started < 120, "the fit must fail at once, not after Spark's barrier wait (minutes)"
    assert trained.checkpoint is before
    if not needs_job:
        assert spark_jobs_started(spark) == jobs, "the error must come before any Spark job"


def test_more_workers_than_local_mode_has_slots_fails_at_once(trained, linear_df):
    before, started, jobs = trained.checkpoint, time.monotonic(), spark_jobs_started(linear_df.sparkSession)
    trained.setNumWorkers(3).setSlotWaitTimeout(60.0)
    try:
        with pytest.raises(InvalidInputError,
                           match=r"numWorkers=3 needs 3 task slots at once, but the cluster offers 2 "
                                 r"\(master=local\[2\].*local mode cannot add slots.*local\[3\]"):
            trained.fit(linear_df)
    finally:
        trained.setNumWorkers(2).setSlotWaitTimeout(1.0)
    assert trained.checkpoint is before and time.monotonic() - started < 10
    assert spark_jobs_started(linear_df.sparkSession) == jobs, "refused from the cluster's slots, before any job"


@pytest.mark.parametrize("layout", ["cached, not yet materialized", "repartitioned"])
def test_more_workers_than_slots_runs_no_spark_job_whatever_the_inputs_caching(spark, linear_df, layout):
    """The slot refusal comes before the fit's first Spark job: describing a cache's plan for
    the rows kept between fits used to materialize the cache first."""
    frame = linear_df.limit(200).repartition(2)
    frame = frame.cache() if layout.startswith("cached") else frame
    est, jobs = linear_estimator(numWorkers=3, slotWaitTimeout=2.0, maxEpochs=1), spark_jobs_started(spark)
    try:
        with pytest.raises(InvalidInputError, match=r"numWorkers=3 needs 3 task slots at once, but the cluster offers"):
            est.fit(frame)
        assert spark_jobs_started(spark) == jobs, "refused from the cluster's slots, before any job"
        assert est.checkpoint is None
    finally:
        frame.unpersist()


def test_data_with_nan_fails_at_its_step_and_keeps_the_run(trained, linear_df):
    before = trained.checkpoint
    poisoned = linear_df.withColumn("label", F.when(F.rand(3) < 0.02, F.lit(float("nan"))).otherwise(F.col("label")))
    with pytest.raises(TrainingFailedError, match=r"non-finite loss \(nan\) at epoch 2, batch \d+.*labelCol 'label' "
                                                  r"hold NaN.*allowNonFinite=True") as error:
        trained.fit(poisoned)
    assert not error.value.retryable and trained.checkpoint is before


def test_weights_that_are_all_zero_fail_naming_weight_col_unless_non_finite_is_allowed(spark, linear_df):
    unweighted = linear_df.withColumn("w", F.lit(0.0))
    est = linear_estimator(weightCol="w", maxEpochs=1)
    with pytest.raises(InvalidInputError, match=r"weightCol 'w'.* sum to 0 .*epoch 1.*allowNonFinite=True"):
        est.fit(unweighted)
    assert est.checkpoint is None and est.history == []

    est.setAllowNonFinite(True).fit(unweighted)
    assert math.isnan(est.history[0]["train_loss"])


def test_vectors_of_different_sizes_in_different_partitions_name_the_column(spark):
    from pyspark.ml.linalg import Vectors

    rows = [(Vectors.dense([1.0] * 8), 1.0)] * 50 + [(Vectors.dense([1.0] * 9), 1.0)] * 50
    df = spark.createDataFrame(rows, ["vec", "label"])  # local data: the first half in partition 0
    est = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), featuresCol="vec",
                         showProgress=False, maxEpochs=1)
    with pytest.raises(InvalidInputError, match="featuresCol 'vec' holds rows of 8 values in some partitions and of 9"):
        est.fit(df)


@pytest.mark.parametrize("setting, value, message", [
    ("batchSize", 0, "batchSize must be at least 1"),
    ("checkpointInterval", "daily", "checkpointInterval must look like"),
    ("timeout", -1.0, "timeout must be a positive"),
    ("minWorkers", 0, r"minWorkers must be between 1 and numWorkers=2 \(or None for numWorkers\), got 0"),
    ("minWorkers", 3, r"minWorkers must be between 1 and numWorkers=2 .*got 3"),
])
def test_nonsense_params(trained, linear_df, spark, setting, value, message):
    before, jobs = trained.checkpoint, spark_jobs_started(spark)
    old = trained.getOrDefault(setting)
    trained._set(**{setting: value})
    try:
        with pytest.raises(InvalidInputError, match=message):
            trained.fit(linear_df)
    finally:
        trained._set(**{setting: old})
    assert trained.checkpoint is before and spark_jobs_started(spark) == jobs


def test_a_bad_duration(trained, linear_df):
    with pytest.raises(InvalidInputError, match="'3 epochs'"):
        trained.fit(linear_df, duration="3 epochs")


def test_corrupt_and_foreign_checkpoints(trained, linear_df, tmp_path):
    corrupt, foreign = tmp_path / "corrupt.pt", tmp_path / "foreign.pt"
    corrupt.write_bytes(b"\x00" * 100)
    torch.save({"state_dict": {"w": torch.zeros(1)}}, foreign)
    before = trained.checkpoint
    with pytest.raises(IncompatibleCheckpointError, match="cannot read checkpoint"):
        trained.fit(linear_df, resume_from=str(corrupt))
    with pytest.raises(IncompatibleCheckpointError, match="missing"):
        trained.fit(linear_df, resume_from=str(foreign))
    assert trained.checkpoint is before


def test_a_checkpoint_path_that_is_not_a_file(trained, linear_df, spark, tmp_path):
    before, jobs = trained.checkpoint, spark_jobs_started(spark)
    for path in ("/nope/x.pt", str(tmp_path)):
        with pytest.raises(InvalidInputError, match=f"resume_from='{path}': cannot read it .*a checkpoint file"):
            trained.fit(linear_df, resume_from=path)
    assert trained.checkpoint is before and spark_jobs_started(spark) == jobs


@pytest.mark.parametrize("field, value", [("progress", "x"), ("history", [1, 2]), ("rng", []), ("optimizer", {}),
                                          ("model", "weights")])
def test_a_tampered_checkpoint_is_refused_before_any_job(trained, linear_df, spark, tmp_path, field, value):
    """format_version 2 kept: the structure is checked, naming the field."""
    state = torch.load(io.BytesIO(trained.checkpoint.to_bytes()), weights_only=True)
    if field == "model":
        state["model"]["weight"] = value
    else:
        state[field] = value
    torch.save(state, tmp_path / "tampered.pt")
    before, jobs = trained.checkpoint, spark_jobs_started(spark)
    with pytest.raises(IncompatibleCheckpointError, match=f"checkpoint field '{field}'"):
        trained.fit(linear_df, resume_from=str(tmp_path / "tampered.pt"))
    assert trained.checkpoint is before and spark_jobs_started(spark) == jobs


def test_an_unwritable_checkpoint_dir_and_a_fifo_are_refused_before_any_job(trained, linear_df, spark, tmp_path):
    (tmp_path / "a-file").write_bytes(b"")
    os.mkfifo(tmp_path / "fifo.pt")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "dir" / "latest")
    before, jobs = trained.checkpoint, spark_jobs_started(spark)
    old = trained.getCheckpointDir()
    trained._set(checkpointDir=str(tmp_path / "a-file" / "ckpt"))
    try:
        with pytest.raises(InvalidInputError, match=f"checkpointDir='{tmp_path}/a-file/ckpt' cannot be written"):
            trained.fit(linear_df)
    finally:
        trained._set(checkpointDir=old)
    for path in (tmp_path / "fifo.pt", tmp_path / "dir"):  # a read would block: refused, not opened
        with pytest.raises(InvalidInputError, match="is not a regular file"):
            trained.fit(linear_df, resume_from=str(path))
    assert trained.checkpoint is before and spark_jobs_started(spark) == jobs


_LOCK = threading.Lock()


@pytest.mark.parametrize("creators, message", [
    ({"model": lambda c: (_LOCK, torch.nn.Linear(8, 1))[1]}, "cannot be pickled"),
    ({"model": lambda c: 1 / 0}, "model creator raised ZeroDivisionError"),
    ({"model": lambda c: {"not": "a module"}}, "returned dict, not a torch.nn.Module"),
    ({"optimizer": lambda m, c: "sgd"}, "not a torch.optim.Optimizer"),
])
def test_bad_creators_fail_before_any_job(spark, linear_df, creators, message):
    settings = dict(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), showProgress=False)
    settings.update(creators)
    est = TorchEstimator(**settings)
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match=message):
        est.fit(linear_df)
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None


def test_a_bad_creator_and_a_missing_column_report_the_creator(spark, linear_df):
    """The frame is planned while the creators are built; the creator's error is the one raised."""
    est = TorchEstimator(model=lambda c: 1 / 0, optimizer=sgd, loss=torch.nn.MSELoss(), showProgress=False)
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match="model creator raised ZeroDivisionError"):
        est.fit(linear_df.drop("label"))
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None


def test_no_job_before_validation_on_a_broadcast_join_without_adaptive_execution(spark, linear_df):
    """Asking such a plan for its partitions would run the broadcast; the frame is repartitioned instead."""
    keys = spark.range(2).withColumnRenamed("id", "key")
    joined = linear_df.withColumn("key", F.lit(1).cast("long")).join(F.broadcast(keys), "key")
    est = TorchEstimator(model=lambda c: 1 / 0, optimizer=sgd, loss=torch.nn.MSELoss(), showProgress=False)
    spark.conf.set("spark.sql.adaptive.enabled", "false")
    try:
        jobs = spark_jobs_started(spark)
        with pytest.raises(InvalidInputError, match="model creator raised"):
            est.fit(joined)
        assert spark_jobs_started(spark) == jobs
    finally:
        spark.conf.unset("spark.sql.adaptive.enabled")


def test_a_loss_that_raises_on_shapes(spark, linear_df):
    est = TorchEstimator(model=linear_model, optimizer=sgd, loss=lambda out, y: out @ y, maxEpochs=1,
                         showProgress=False)
    with pytest.raises(TrainingFailedError) as error:
        est.fit(linear_df)
    assert error.value.stage == "loss" and not error.value.retryable
    assert "RuntimeError" in str(error.value)
    assert isinstance(error.value, SparkTorchError)


class ReturnsAFlag(Hook):
    def before_train_iter(self, batch):
        return True  # meant: "go on"; the stage takes a replacement batch


class PredictionAndFeatures(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.linear(x), x


@pytest.mark.parametrize("settings, words", [
    ({"hooks": [ReturnsAFlag()]}, "hook 'ReturnsAFlag' (ReturnsAFlag).before_train_iter() returned bool True; "
                                  "expected None or a replacement batch (inputs, labels)"),
    ({"model": lambda config: PredictionAndFeatures()},
     "the model's forward (PredictionAndFeatures) returned a tuple of 2 (a Tensor of shape [2, 1], a Tensor of "
     "shape [2, 8]); expected one torch.Tensor of outputs"),
])
def test_user_code_that_returns_the_wrong_kind_is_named_with_what_was_expected_never_our_bug(
        spark, linear_df, settings, words):
    est = linear_estimator(maxEpochs=1, **settings)
    with pytest.raises(TrainingFailedError) as error:
        est.fit(linear_df)
    assert words in str(error.value) and "a bug in spark_torch_est" not in str(error.value)
    assert not error.value.retryable and est.checkpoint is None


def test_after_all_that_a_good_fit_resumes_the_intact_run(trained, linear_df):
    assert trained.progress.epoch == 1
    trained.fit(linear_df)
    assert trained.progress.epoch == 3 and [e["epoch"] for e in trained.history] == [1, 2, 3]


def test_feature_cols_messages_name_the_column_and_the_feature_count(spark):
    """Nulls in one of featureCols name that column; a model of another width hears how many features it got."""
    rows = [(None if i % 50 == 0 else float(i), 1.0, 2.0, 3.0, float(i % 3)) for i in range(200)]
    df = spark.createDataFrame(rows, "a double, b double, c double, d double, label double")
    est = TorchEstimator(model=lambda c: torch.nn.Linear(5, 1), optimizer=sgd, loss=torch.nn.MSELoss(),
                         featureCols=["a", "b", "c", "d"], maxEpochs=1, numWorkers=2, showProgress=False)
    with pytest.raises(InvalidInputError, match=r"featureCols: column 'a' has \d+ null values in this partition; "
                                                r"drop or fill them first, e\.g\. df\.na\.drop\(subset=\['a'\]\)"):
        est.fit(df)
    with pytest.raises(TrainingFailedError, match=r"mat1 and mat2 shapes cannot be multiplied \(2x4 and 5x1\); the "
                                                  r"model was given 4 features per row \(featureCols \['a', 'b', 'c', "
                                                  r"'d'\]\)"):
        est.fit(df.na.fill(0.0))


def _package_frames(error: BaseException) -> list[str]:
    """The package's frames in the traceback a user sees of ``error`` (with its chain)."""
    import traceback

    text = "".join(traceback.format_exception(error))
    return [line for line in text.splitlines() if line.strip().startswith("File ") and "spark_torch_est" in line
            and "/tests/" not in line]


def test_an_error_before_any_job_shows_the_users_frame_and_few_of_the_packages(spark, linear_df):
    """A bad labelCol read as one clear line under a 104-line traceback with 15 of the
    package's frames, concurrent.futures among them."""
    import traceback

    est = linear_estimator(labelCol="no_such_column", showProgress=False)
    with pytest.raises(InvalidInputError) as caught:
        est.fit(linear_df)  # the user's line
    text = "".join(traceback.format_exception(caught.value))
    assert "no_such_column" in text and "est.fit(linear_df)  # the user's line" in text, text
    assert "concurrent" not in text and "threading.py" not in text, text
    assert len(_package_frames(caught.value)) <= 3, text
    with pytest.raises(SparkTorchError) as caught:
        est.setLabelCol("label").fit(linear_df, duration="0ep")
    assert len(_package_frames(caught.value)) <= 3, "".join(traceback.format_exception(caught.value))
