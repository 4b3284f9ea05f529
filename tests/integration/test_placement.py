"""How a fit's rows through Spark get their places in the run: by the order Spark gives them
where every job reproduces it (nothing hashed, nothing moved at launch), by hashing them where
it may not, and the fit's log says which and why."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F

from spark_torch_est.cluster.launcher import STAGING
from spark_torch_est.core import jvm
from spark_torch_est.core.protocol import LABEL
from spark_torch_est.core.running import PROGRESS_LOGGER
from spark_torch_est.ingest import kept_registry
from spark_torch_est.ingest.frames import ROW_ORDER, _by_position, _partition_keys, spark_hash_long
from spark_torch_est.ingest.staged import stage, staged_batches
from spark_torch_est.planning import input_schema_of, plan_frame
from tests.helpers import SeenRows, linear_estimator, seen_rows

pytestmark = pytest.mark.spark

ROWS = 1000


@pytest.fixture(scope="module")
def numbered(spark):
    """1,000 rows in 3 partitions of a range: 8 seeded random features, the row's number as the label."""
    return spark.range(0, ROWS, 1, 3).select(F.array(*[F.rand(seed=i) for i in range(8)]).alias("features"),
                                              F.col("id").cast("double").alias("label"))


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


@pytest.mark.compat
def test_rows_in_a_reproducible_order_are_not_hashed_and_keep_their_places_on_any_number_of_workers(
        spark, numbered, tmp_path, caplog):
    seen = tmp_path / "seen"
    seen.mkdir()
    est = linear_estimator(maxEpochs=2, batchSize=32, hooks=[SeenRows(str(seen))])
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        est.fit(numbered, duration="1ep")
    assert est.checkpoint.data_source == "spark:positions"
    assert not any("hashing" in m for m in _messages(caplog)), "nothing is hashed"
    frame, _ = plan_frame(est, numbered, input_schema_of(est, numbered), 2, 2)
    partitions = frame.rdd.glom().map(lambda rows: sorted(int(r[LABEL]) for r in rows)).collect()  # the same plan
    for rank, rows in enumerate(partitions):
        assert sorted(int(v) for path in seen.glob(f"epoch0-rank{rank}-*") for v in path.read_text().split()) == \
            rows, "each rank trains the logical partition it read: none moves"
    est.setNumWorkers(1).fit(numbered, duration="10ba")  # another number of ranks: rows carry their places
    est.setNumWorkers(2).fit(numbered)
    assert est.progress.epoch == 2
    assert seen_rows(str(seen), 1) == list(range(ROWS)), "every row once in an epoch on 2, 1 and 2 ranks"
    whole = linear_estimator(maxEpochs=2, batchSize=32)
    whole.fit(numbered)
    split = linear_estimator(maxEpochs=2, batchSize=32)
    split.fit(numbered, duration="9ba")
    split.fit(numbered)
    for key, value in whole.checkpoint.model_state.items():
        assert torch.equal(value, split.checkpoint.model_state[key]), key


@pytest.mark.parametrize("shards", [2, 3, 5])
def test_the_logical_partitions_deal_out_the_rows_by_position_without_sorting_the_input(spark, numbered, shards):
    est = linear_estimator(numWorkers=shards)
    frame, _ = plan_frame(est, numbered, input_schema_of(est, numbered), shards, shards)
    plan = frame._jdf.queryExecution().executedPlan().toString()
    assert "RoundRobinPartitioning" not in plan, "Spark's round robin sorts every input partition first"
    partitions = frame.rdd.glom().map(lambda rows: [int(r[LABEL]) for r in rows]).collect()
    assert len(partitions) == shards and sorted(sum(partitions, [])) == list(range(ROWS))
    assert all(rows == sorted(rows) for rows in partitions), "each in the input's order"
    sizes = [len(rows) for rows in partitions]
    assert max(sizes) - min(sizes) <= numbered.rdd.getNumPartitions(), sizes
    again, _ = plan_frame(est, numbered, input_schema_of(est, numbered), shards, shards)
    assert again.rdd.glom().map(lambda rows: [int(r[LABEL]) for r in rows]).collect() == partitions


def test_the_partition_keys_are_sent_where_sparks_hash_partitioning_sends_them(spark):
    values = [0, 1, -1, 2**33 + 5, -(2**63), 2**63 - 1, *np.random.default_rng(0).integers(-2**63, 2**63 - 1, 100)]
    hashed = spark.createDataFrame([(int(v),) for v in values], "v long").select(F.hash("v")).collect()
    assert [row[0] for row in hashed] == [spark_hash_long(int(v)) for v in values]
    keys = _partition_keys(7)
    placed = spark.createDataFrame([(k,) for k in keys], "k long").repartition(7, "k") \
        .select("k", F.spark_partition_id().alias("p")).collect()
    assert sorted((keys.index(row.k), row.p) for row in placed) == [(j, j) for j in range(7)]


def test_a_dataframe_whose_order_may_change_between_jobs_is_placed_by_hashing_and_the_log_says_why(
        spark, numbered, caplog):
    shuffled = numbered.repartition(4)
    est = linear_estimator(maxEpochs=1, batchSize=32)
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        est.fit(shuffled)
    assert est.checkpoint.data_source == "spark"
    assert any("placed in the run by hashing them" in m and "its plan shuffles" in m for m in _messages(caplog))
    cached = shuffled.cache()
    try:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="spark_torch_est"):
            linear_estimator(maxEpochs=1, batchSize=32).fit(cached)
        assert not any("hashing" in m for m in _messages(caplog)), "a cache keeps the order it was first computed in"
    finally:
        cached.unpersist()


@pytest.mark.compat
def test_which_plans_reproduce_their_order(spark, numbered, linear_df, tmp_path):
    path = str(tmp_path / "table")
    numbered.write.parquet(path)
    table = spark.read.parquet(path)
    broadcast_join = table.join(numbered.withColumnRenamed("features", "f"), "label")  # in the big side's order
    for ordered in (numbered, table, table.filter("label > 3").select("features"), linear_df,
                    numbered.union(table), numbered.coalesce(1), broadcast_join):
        assert jvm.order_unstable(ordered) is None, ordered._jdf.queryExecution().executedPlan().toString()
    rdd = spark.sparkContext.parallelize(range(10), 2)
    for unordered, why in ((numbered.repartition(2), "shuffles"), (table.groupBy("label").count(), "shuffles"),
                           (table.join(numbered.withColumnRenamed("features", "f").hint("merge"), "label"),
                            "shuffles"),
                           (spark.createDataFrame(rdd.map(lambda i: (i,)).repartition(3), "x long"), "RDD")):
        assert why in (jvm.order_unstable(unordered) or ""), unordered._jdf.queryExecution().executedPlan().toString()


def _staged_folders(spark) -> set[str]:
    roots = [jvm.driver_files_dir(spark.sparkContext), *jvm.local_dirs(spark.sparkContext)]
    return {folder for root in roots if root
            for folder in glob.glob(os.path.join(glob.escape(root), "spark_torch_est-staged-*"))}


@pytest.mark.compat
def test_a_first_fit_on_one_host_reads_the_rows_staged_as_the_shuffle_would_bring_them_and_removes_them(
        spark, numbered, caplog, monkeypatch):
    before, made = _staged_folders(spark), []
    real_mkdtemp = kept_registry.tempfile.mkdtemp

    def noted(prefix, dir):
        made.append(real_mkdtemp(prefix=prefix, dir=dir))
        return made[-1]

    monkeypatch.setattr(kept_registry.tempfile, "mkdtemp", noted)
    staged = linear_estimator(maxEpochs=2, batchSize=32, keepIngestedMB=0)
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        staged.fit(numbered)
    assert len(made) == 1 and os.path.dirname(made[0]) == jvm.driver_files_dir(spark.sparkContext), \
        "in the driver's folder that Spark removes when the session stops or the driver exits"
    assert any(m.startswith(f"staged {ROWS} rows of 3 partitions") for m in _messages(caplog)), _messages(caplog)
    shown = [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER and r.getMessage().endswith(" ...")]
    assert [m[:len("launching 2 ranks")] if m.startswith("launching") else m for m in shown[1:4]] == \
        ["launching 2 ranks", f"{STAGING} ...", "launching 2 ranks"], "the staging job is a phase of its own"
    assert _staged_folders(spark) == before, "the staged rows go when the fit ends"
    monkeypatch.setattr(jvm, "one_host", lambda session: False)  # as a cluster of several hosts
    caplog.clear()
    shuffled = linear_estimator(maxEpochs=2, batchSize=32, keepIngestedMB=0)
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        shuffled.fit(numbered)
    assert "the rows come through Spark's shuffle: the executors run on more than one host" in _messages(caplog)
    assert [h["train_loss"] for h in staged.history] == [h["train_loss"] for h in shuffled.history]
    for key, value in staged.checkpoint.model_state.items():
        assert torch.equal(value, shuffled.checkpoint.model_state[key]), "the same rows on the same ranks, in order"


def test_staged_rows_a_rank_cannot_read_are_read_through_the_shuffle_in_the_same_fit(spark, numbered, tmp_path,
                                                                                      caplog, monkeypatch):
    real = kept_registry.stage

    def elsewhere(frame, shards, directory, run):  # written where the ranks cannot read them (another host)
        return dataclasses.replace(real(frame, shards, directory, run), directory=str(tmp_path / "on-another-host"))

    reference = linear_estimator(maxEpochs=1, batchSize=32, keepIngestedMB=0)
    reference.fit(numbered)
    monkeypatch.setattr(kept_registry, "stage", elsewhere)
    est = linear_estimator(maxEpochs=1, batchSize=32, keepIngestedMB=0, maxRetries=0)
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        est.fit(numbered)
    assert any("could not read the staged rows" in m for m in _messages(caplog)), _messages(caplog)
    assert est.progress.epoch == 1, "the fit trained, its relaunch not counted against maxRetries=0"
    for key, value in reference.checkpoint.model_state.items():
        assert torch.equal(value, est.checkpoint.model_state[key])


@pytest.mark.compat
def test_the_staged_files_hold_each_logical_partition_as_the_shuffle_deals_it_out(spark, tmp_path):
    frame = spark.range(0, 1000, 1, 4).select("id", (F.col("id") * 2).cast("double").alias("twice"))
    for shards in (1, 2, 3, 5):  # Spark numbers partitions and rows as the positions say, for any count
        folder = tmp_path / f"staged-{shards}"
        folder.mkdir()
        staged = stage(frame, shards, str(folder), jvm.collect_arrow)
        shuffled = _by_position(frame.select("*", F.monotonically_increasing_id().alias(ROW_ORDER)), shards)
        partitions = shuffled.rdd.glom().map(lambda rows: [row.id for row in rows]).collect()
        for shard in range(shards):
            got = [value for batch in staged_batches(staged, shard, shards) for value in batch.column("id").to_pylist()]
            assert got == partitions[shard], f"logical partition {shard} of {shards}"


def test_a_staging_job_that_fails_leaves_the_rows_to_the_shuffle_in_the_same_launch(spark, numbered, tmp_path,
                                                                                     caplog, monkeypatch):
    reference = linear_estimator(maxEpochs=1, batchSize=32, keepIngestedMB=0)
    reference.fit(numbered)
    unwritable = str(tmp_path / "not-there" / "staged")  # the tasks cannot write (another user's, a full disk)
    monkeypatch.setattr(kept_registry.tempfile, "mkdtemp", lambda prefix, dir: unwritable)
    est = linear_estimator(maxEpochs=1, batchSize=32, keepIngestedMB=0, maxRetries=0)
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        est.fit(numbered)
    assert any(m.startswith("the rows come through Spark's shuffle: staging them failed") for m in _messages(caplog))
    for key, value in reference.checkpoint.model_state.items():
        assert torch.equal(value, est.checkpoint.model_state[key])
