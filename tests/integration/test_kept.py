"""Fit many, ingest once: a later fit on the same unchanged DataFrame trains on the rows the
executors kept, bitwise as if read again; any change to the rows or the plan reads them
again; what is kept is bounded and released."""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_torch_est import TorchEstimator
from spark_torch_est.ingest import kept_registry
from spark_torch_est.ingest.kept_registry import frame_key
from spark_torch_est.planning import input_schema_of, plan_frame
from tests.helpers import CrashOnce, linear_estimator

pytestmark = pytest.mark.spark

REUSED = "kept this DataFrame's rows"


def _write(path, rows: int, seed: int, name: str = "part-0.parquet") -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 4), dtype=np.float32)
    os.makedirs(path, exist_ok=True)
    pq.write_table(pa.table({"features": pa.array(list(x), pa.list_(pa.float32())),
                             "label": x.sum(1).astype(np.float64), "w": np.ones(rows)}), os.path.join(path, name))


#: This module's estimator: tests.helpers.linear_estimator with these settings.
SETTINGS = dict(model=lambda config: torch.nn.Linear(4, 1),
                optimizer=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.05),
                batchSize=32, maxEpochs=100, seed=1)


def _key(estimator: TorchEstimator, df, workers: int | None = None) -> str | None:
    schema = input_schema_of(estimator, df)
    frame, _ = plan_frame(estimator, df, schema, workers or estimator.getNumWorkers(), None)
    described = frame_key(frame)
    return described[0] if described is not None else None


def _local_dir(spark) -> str:
    return spark.sparkContext.parallelize([0], 1).map(lambda _: os.environ["SPARK_LOCAL_DIRS"]).first().split(",")[0]


def _kept(spark) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(_local_dir(spark), "spark_torch_est-kept", "*")))


@pytest.mark.compat
def test_the_key_changes_with_anything_that_changes_the_rows(spark, tmp_path):
    path = str(tmp_path / "t")
    _write(path, 200, seed=0)
    est = linear_estimator(SETTINGS)
    df = spark.read.parquet(path)
    filtered = df.filter("label > 0")
    key = _key(est, filtered)
    assert key is not None and key == _key(est, spark.read.parquet(path).filter("label > 0")), \
        "the same plan over the same files"
    assert _key(est, df.filter("label > 1")) != key, "another filter"
    assert _key(est, filtered, workers=3) != key, "another numWorkers"
    assert _key(linear_estimator(SETTINGS, weightCol="w"), filtered) != key, "another column set"
    assert _key(linear_estimator(SETTINGS, labelCol="w"), filtered) != key, "another label"
    _write(path, 50, seed=1, name="part-1.parquet")
    assert _key(est, spark.read.parquet(path).filter("label > 0")) != key, "new files"
    rewritten = _key(est, spark.read.parquet(path).filter("label > 0"))
    _write(path, 50, seed=2, name="part-1.parquet")
    assert _key(est, spark.read.parquet(path).filter("label > 0")) != rewritten, "a file rewritten"

    cached = spark.read.parquet(path).cache()
    try:
        cached_key = _key(est, cached)
        assert cached_key is not None and cached_key == _key(est, spark.read.parquet(path)), \
            "a DataFrame of the cached plan reads the cache"
        cached.unpersist()
        _write(path, 50, seed=3, name="part-1.parquet")
        cached = spark.read.parquet(path).cache()
        assert _key(est, cached) != cached_key, "a cache unpersisted and made again from changed files"
    finally:
        cached.unpersist()

    local = spark.createDataFrame([([1.0, 2.0, 3.0, 4.0], 1.0)], ["features", "label"])
    assert _key(est, local) is None, "local rows: not in the plan's text"
    from pyspark.sql import functions as F

    udf = F.udf(lambda v: v * 2, "double")
    assert _key(est, df.withColumn("label", udf("label"))) is None, "a Python UDF's code is not in the plan"


@pytest.mark.compat
def test_later_fits_train_on_kept_rows_bitwise_as_if_read_again(spark, tmp_path, caplog):
    path = str(tmp_path / "t")
    _write(path, 600, seed=0)
    df = spark.read.parquet(path).filter("label > -100").repartition(3).cache()  # more partitions than ranks
    try:
        kept = linear_estimator(SETTINGS)
        with caplog.at_level(logging.INFO, logger="spark_torch_est.fit"):
            kept.fit(df, duration="1ep")
            assert REUSED not in caplog.text and _kept(spark), "the first fit reads through Spark and keeps"
            assert "staged 600 rows of 3 partitions" in caplog.text
            parts = glob.glob(os.path.join(_local_dir(spark), "spark_torch_est-kept", _key(kept, df), "part-*"))
            assert len(parts) == 2 and all(len(os.listdir(part)) == 3 for part in parts), \
                "each rank kept the staged files it read (one per input partition), not a copy of its rows"
            kept.fit(df, duration="1ep")
            assert REUSED in caplog.text, "the second reads what was kept"
        fresh = linear_estimator(SETTINGS, keepIngestedMB=0)
        fresh.fit(df, duration="2ep")
        for a, b in zip(kept.checkpoint.model_state.values(), fresh.checkpoint.model_state.values()):
            assert torch.equal(a, b)
        assert kept.progress == fresh.progress
    finally:
        df.unpersist()


def test_a_recomputed_cache_is_read_again_and_the_old_rows_released(spark, tmp_path, caplog):
    path = str(tmp_path / "t")
    _write(path, 300, seed=0)
    df = spark.read.parquet(path).cache()
    others = set(_kept(spark))  # what earlier tests' caches keep
    est = linear_estimator(SETTINGS)
    est.fit(df, duration="1ep")
    before = set(_kept(spark)) - others
    assert before
    df.unpersist()
    _write(path, 500, seed=1)  # the same file, more rows
    df = spark.read.parquet(path).filter("label > -100").cache()
    try:
        samples = est.progress.samples
        with caplog.at_level(logging.INFO, logger="spark_torch_est.fit"):
            est.fit(df, duration="1ep")
        assert REUSED not in caplog.text
        assert est.progress.samples - samples >= 500, "the new rows"
        after = set(_kept(spark))
        assert not before & after, "the unpersisted cache's rows were removed"
    finally:
        df.unpersist()


def test_rows_past_the_bound_are_not_kept_and_the_next_fit_reads_through_spark(spark, tmp_path, caplog):
    path = str(tmp_path / "t")
    _write(path, 300, seed=0)
    df = spark.read.parquet(path).filter("label > -50")
    est = linear_estimator(SETTINGS, keepIngestedMB=1e-6)  # about one byte
    est.fit(df, duration="1ep")
    with caplog.at_level(logging.INFO, logger="spark_torch_est.fit"):
        est.fit(df, duration="1ep")
    assert "reading it through Spark again" in caplog.text
    assert est.progress.epoch == 2


@pytest.mark.compat
def test_an_unpersisted_dataframes_rows_are_released_without_another_fit(spark, tmp_path):
    path = str(tmp_path / "t")
    _write(path, 300, seed=0)
    df = spark.read.parquet(path).filter("label > -100").cache()
    est = linear_estimator(SETTINGS)
    est.fit(df, duration="1ep")
    folder = os.path.join(_local_dir(spark), "spark_torch_est-kept", _key(est, df))
    assert os.path.isdir(folder) and os.listdir(folder)
    df.unpersist()
    deadline = time.monotonic() + 15
    while os.path.exists(folder) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(folder), "released when its DataFrame was unpersisted, before any other fit"
    if not any(kept_registry._KEPT.keys.values()):  # earlier tests' caches, still persisted, keep it watching
        while any(t.name == "spark_torch_est-kept-watch" for t in threading.enumerate()) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(t.name == "spark_torch_est-kept-watch" for t in threading.enumerate()), \
            "nothing of a cache is kept any more: nothing watches"


def test_a_relaunch_trains_on_the_rows_the_failed_job_kept_bitwise(spark, tmp_path, caplog):
    path = str(tmp_path / "t")
    _write(path, 600, seed=0)
    df = spark.read.parquet(path).filter("label > -100").cache()
    try:
        clean = linear_estimator(SETTINGS, keepIngestedMB=0, maxEpochs=3)
        clean.fit(df)
        crash = CrashOnce(str(tmp_path / "crashed"), epoch=1, batch=2)
        crashing = linear_estimator(SETTINGS, maxEpochs=3, hooks=[crash], checkpointDir=str(tmp_path / "ckpt"),
                                    maxRetries=1)
        with caplog.at_level(logging.INFO, logger="spark_torch_est"):
            crashing.fit(df)
        assert (tmp_path / "crashed").exists()
        assert "the relaunch takes the rows the failed job's ranks kept" in caplog.text
        assert "reading it through Spark again" not in caplog.text, "every part survived the crash"
        for a, b in zip(clean.checkpoint.model_state.values(), crashing.checkpoint.model_state.values()):
            assert torch.equal(a, b)
        assert crashing.progress == clean.progress
    finally:
        df.unpersist()


@pytest.mark.slow  # a session of its own, stopped: about 18 s
def test_the_kept_rows_go_when_the_session_stops(tmp_path):
    script = Path(__file__).parent / "scripts" / "kept_until_stop.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "local")], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    files = json.loads(done.stdout.strip().splitlines()[-1])
    assert files == {"before": 2, "after": 0}, "one part per rank while the session runs, none after it stopped"
