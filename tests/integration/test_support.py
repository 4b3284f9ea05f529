"""The support matrix on the row this runs on (``make test-compat`` runs it on every row):
what the installed Spark and torch cannot carry is refused before any job, every reach
into Spark's JVM answers, and a bug of the package is never retried as a system failure."""

from __future__ import annotations

import re
from importlib.metadata import version

import pyarrow as pa
import pytest

from spark_torch_est.core import jvm
from spark_torch_est.core.support import FSDP, FSDP_CPU, installed
from spark_torch_est.errors import InvalidInputError, TrainingFailedError
from tests.helpers import estimator, spark_jobs_started

pytestmark = [pytest.mark.spark, pytest.mark.compat]


@pytest.mark.skipif(installed("torch") >= FSDP_CPU.needs, reason="this torch trains FSDP2 on CPU (test_fsdp.py)")
def test_fsdp_on_a_torch_without_it_is_refused_before_any_job_naming_the_version(spark, linear_df, tmp_path):
    """torch 2.3 has no public FSDP2; torch 2.6's fails on CPU ranks."""
    needed = "needs torch >= 2.6" if installed("torch") < FSDP.needs else "on CPU ranks needs torch >= 2.7"
    est = estimator(strategy="fsdp", checkpointDir=str(tmp_path))
    jobs = spark_jobs_started(spark)
    torch_version = re.escape(version("torch"))
    with pytest.raises(InvalidInputError, match=rf'strategy="fsdp" {needed} .* has torch {torch_version}'):
        est.fit(linear_df)
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None


def test_every_reach_into_the_jvm_answers_on_this_spark(spark, tmp_path):
    df = spark.range(10).selectExpr("id", "cast(id as double) as x")
    table = jvm.collect_arrow(df)
    assert table.column("x").to_pylist() == [float(i) for i in range(10)]
    empty = jvm.collect_arrow(df.where("id < 0"))
    assert empty.num_rows == 0 and empty.schema.field("x").type == pa.float64()

    assert jvm.task_slots(spark) == 2  # local[2]
    assert jvm.broadcast_threshold(spark) == 10 * 2**20  # Spark's default, parsed
    assert 0 < jvm.plan_size_bytes(df) < 2**20
    assert jvm.barrier_partitions(df.repartition(3)) is None  # a shuffle: Spark would have to run it to know
    spark.range(100).write.parquet(str(tmp_path / "t"))
    files = spark.read.parquet(str(tmp_path / "t"))
    assert jvm.barrier_partitions(files) == files.rdd.getNumPartitions()
    roots, scanned = jvm.parquet_scan(files, ["id"])
    assert roots and [f for f in scanned if f.endswith(".parquet")] == sorted(files.inputFiles())

    spark.conf.set("spark.sql.session.timeZone", "UTC")
    assert jvm.sql_settings(spark)["spark.sql.session.timeZone"] == "UTC"
    files.cache().count()
    text, leaves, caches = jvm.describe_plan(files.select("id"))  # a new plan: the cache replaces the scan
    assert text and leaves == [["cache", caches[0]]] and jvm.cache_alive(spark.sparkContext)(caches[0])
    files.unpersist(blocking=True)
    assert not jvm.cache_alive(spark.sparkContext)(caches[0])
    assert jvm.describe_plan(files.selectExpr("uuid()")) is None  # not determined by its plan
    assert jvm.local_dirs(spark.sparkContext)


def test_a_bug_of_the_package_on_the_driver_fails_at_once_and_is_not_retried(spark, linear_df, monkeypatch):
    """What pyspark 3.5 did to the 0.1 release: ``DataFrame.toArrow`` is missing. Such an
    error of the package's own code is reported as a bug, not relaunched as a system failure."""
    import spark_torch_est.cluster.launcher as launcher

    def collect_arrow(df):
        return df.toArrowTable()  # no such method: an AttributeError raised in this test's code

    monkeypatch.setattr(launcher, "collect_arrow", collect_arrow)
    est = estimator(maxRetries=3, maxEpochs=1)
    jobs = spark_jobs_started(spark)
    with pytest.raises(TrainingFailedError, match="AttributeError: .*toArrowTable.*a bug in spark_torch_est") as error:
        est.fit(linear_df)
    assert not error.value.retryable and est.checkpoint is None
    assert spark_jobs_started(spark) == jobs  # the job never ran, and nothing relaunched it
