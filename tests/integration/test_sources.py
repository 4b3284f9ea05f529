"""Plain Parquet tables are read by the ranks themselves: only those, the same rows, exact resume."""

from __future__ import annotations

import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F

from spark_torch_est import Hook, TorchModel
from spark_torch_est.errors import InputDataError
from spark_torch_est.ingest.frames import frame_outputs, input_schema
from spark_torch_est.ingest.parquet_plan import parquet_source
from tests.helpers import CrashOnce, SeenRows, estimator, linear_estimator, seen_rows, tasks_read_files

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def table(spark, linear_data, tmp_path_factory):
    """The linear data as a Parquet table of 3 files, a row id beside each row."""
    x, y, _, _ = linear_data
    path = str(tmp_path_factory.mktemp("table") / "linear")
    rows = [(i, row.tolist(), Vectors.dense(row.tolist()), float(t), i % 7 == 0)
            for i, (row, t) in enumerate(zip(x, y))]
    spark.createDataFrame(rows, ["id", "features", "vec", "label", "is_val"]).repartition(3).write.parquet(path)
    return path


def _source(df, **params):
    settings = dict(features_col="features", feature_cols=None, label_col="label", validation_col=None,
                    weight_col=None)
    settings.update(params)
    schema = input_schema(df.schema, features_col=settings["features_col"], feature_cols=settings["feature_cols"],
                          input_cols=settings.pop("input_cols", None))
    return parquet_source(df, frame_outputs(df, schema=schema, **settings), 2)


@pytest.mark.compat
def test_only_a_plain_scan_of_parquet_files_is_read_directly(spark, table, tmp_path):
    df = spark.read.parquet(table)
    source = _source(df)
    assert source is not None and len(source.parts) == 2
    rows = [sum(p.stop - p.start for p in part) for part in source.parts]
    assert rows == [1500, 1500] and {p.path for part in source.parts for p in part} == set(df.inputFiles())
    assert _source(df.select("features", "label")) is not None
    assert _source(df, input_cols=["id", "vec"]) is not None
    for other in (df.filter("label > 0"), df.withColumn("label", F.col("label") * 2), df.cache(),
                  df.union(df), df.select("*", F.lit(1).alias("one"))):
        assert _source(other) is None, other._jdf.queryExecution().executedPlan().toString()
    df.unpersist()
    spark.read.parquet(table).write.partitionBy("is_val").parquet(str(tmp_path / "partitioned"))
    assert _source(spark.read.parquet(str(tmp_path / "partitioned"))) is None


def test_typed_columns_from_the_files_every_row_once_per_epoch(spark, table, tmp_path):
    df = spark.read.parquet(table)
    model = estimator(model=lambda c: _IdAndVector(), optimizer=_sgd, inputCols=["id", "vec"], maxEpochs=2,
                      hooks=[SeenRows(str(tmp_path), first_input=True)]).fit(df)
    for epoch in (0, 1):
        assert seen_rows(tmp_path, epoch) == list(range(3000)), "ids read as exact int64, every row once"
    scored = model.transform(df).select("label", "prediction").toPandas()
    assert float(((scored["label"] - scored["prediction"]) ** 2).mean()) < 0.5


class _IdAndVector(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, row_id, vec):
        if row_id.dtype != torch.int64:
            raise TypeError(f"ids must stay int64, got {row_id.dtype}")
        return self.linear(vec)


def _sgd(model, config):
    return torch.optim.SGD(model.parameters(), lr=0.05)


@pytest.mark.compat
def test_a_table_read_from_its_files_learns_and_resumes_exactly(spark, table, linear_data, tmp_path):
    _, _, w, b = linear_data
    df = spark.read.parquet(table)
    whole = linear_estimator(maxEpochs=4, validationIndicatorCol="is_val")
    model = whole.fit(df)
    np.testing.assert_allclose(model.torch_model().weight.detach().numpy().ravel(), w, atol=0.05)
    split = linear_estimator(maxEpochs=4, validationIndicatorCol="is_val")
    split.fit(df, duration="30ba")
    split.fit(df)
    crashed = linear_estimator(maxEpochs=4, validationIndicatorCol="is_val", checkpointDir=str(tmp_path / "ckpt"),
                               hooks=[CrashOnce(str(tmp_path / "crashed"), batch=3)])
    crashed.fit(df)
    assert (tmp_path / "crashed").exists()
    for other in (split, crashed):
        for key, value in whole.checkpoint.model_state.items():
            assert torch.equal(value, other.checkpoint.model_state[key]), key
    assert "val_loss" in whole.history[-1] and whole.checkpoint.data_source != "spark"




def test_switching_paths_mid_epoch_continues_the_epoch_from_the_same_fraction_and_says_so(spark, table, caplog):
    """The same rows read through Spark: read directly, the rows took their places from the
    files' order, through Spark from hashing them, so the epoch goes on from the same
    fraction, and rank 0 says so."""
    df = spark.read.parquet(table)
    est = linear_estimator(maxEpochs=2)
    est.fit(df, duration="10ba")
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        est.fit(df.cache(), duration="1ep")
    df.unpersist()
    assert est.progress.epoch == 1
    assert any("same fraction" in r.getMessage() and "read through Spark" in r.getMessage()
               and "read from the table's files" in r.getMessage() for r in caplog.records)


def test_direct_read_can_be_switched_off_for_fit_transform_evaluate_and_a_saved_model(spark, table, tmp_path,
                                                                                         caplog):
    df = spark.read.parquet(table)
    est = linear_estimator(maxEpochs=1, directRead=False)
    model = est.fit(df)
    assert est.checkpoint.data_source == "spark:positions"  # a file scan comes in its order
    assert model.getDirectRead() is False and not tasks_read_files(model.transform(df))
    with caplog.at_level(logging.INFO, logger="spark_torch_est.model"):
        model.evaluate(df)
    assert not any("directly" in r.getMessage() for r in caplog.records)
    model.save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.getDirectRead() is False and not tasks_read_files(loaded.transform(df))
    assert tasks_read_files(loaded.setDirectRead(True).transform(df))


def test_files_without_the_columns_by_their_exact_names_go_through_spark(spark, table, tmp_path):
    upper = spark.read.parquet(table).withColumnRenamed("features", "Features")
    upper.write.parquet(str(tmp_path / "upper"))
    df = spark.read.parquet(str(tmp_path / "upper")).select(F.col("features"), "label")  # resolved ignoring case
    assert _source(df) is None


@pytest.mark.compat
def test_a_scored_table_reads_its_files_only_where_a_join_would_broadcast_it_alike(spark, table, caplog):
    """transform's tasks run over a range of the table's rows, which Spark takes for 8 bytes
    a row: where a join would then broadcast a table Spark itself would not, Spark scans it.
    evaluate collects its result at once, so it reads the files either way."""
    df = spark.read.parquet(table)
    model = linear_estimator(maxEpochs=1).fit(df)
    table_bytes = int(str(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()))
    assert 8 * 3000 < table_bytes
    key, before = "spark.sql.autoBroadcastJoinThreshold", spark.conf.get("spark.sql.autoBroadcastJoinThreshold")
    try:
        spark.conf.set(key, str((8 * 3000 + table_bytes) // 2))  # the rows' 8 bytes fit, the table does not
        scored = model.transform(df)
        assert not tasks_read_files(scored)
        other = spark.range(table_bytes).withColumnRenamed("id", "k")  # too big to broadcast as well
        joined = other.join(scored, F.col("k") == scored.id)
        assert "BroadcastExchange" not in joined._jdf.queryExecution().executedPlan().toString()
        with caplog.at_level(logging.INFO, logger="spark_torch_est.model"):
            evaluated = model.evaluate(df)
        assert any("reads 3000 rows in" in r.getMessage() for r in caplog.records)
        assert evaluated == pytest.approx(model.copy({model.directRead: False}).evaluate(df), rel=1e-6)
        spark.conf.set(key, "-1")  # no broadcast joins: nothing to mislead
        assert tasks_read_files(model.transform(df))
    finally:
        spark.conf.set(key, before)
    assert tasks_read_files(model.transform(df)), "under the default 10 MB both sizes allow a broadcast"


class CountRows(Hook):
    """Appends the size and label sum of every training batch of epoch ``epoch`` to
    ``<directory>/rows-<rank>-<pid>``."""

    def __init__(self, directory: str, epoch: int = 0) -> None:
        self.directory, self.epoch = directory, epoch

    def after_train_iter(self, labels, rank, epoch):
        if epoch == self.epoch:
            with open(os.path.join(self.directory, f"rows-{rank}-{os.getpid()}"), "a") as out:
                out.write(f"{len(labels)} {float(labels.double().sum())}\n")

    def totals(self) -> tuple[int, float]:
        """Rows and label sum over every rank."""
        lines = [line.split() for path in os.scandir(self.directory) for line in open(path.path)]
        return sum(int(n) for n, _ in lines), sum(float(t) for _, t in lines)


def test_overlapping_input_paths_train_and_score_every_row_spark_reads(spark, table, tmp_path):
    one_file = next(p for p in os.listdir(table) if p.endswith(".parquet"))
    for paths in ((table, table), (table, os.path.join(table, one_file))):
        df = spark.read.parquet(*paths)
        expected = df.count()  # Spark reads a file once per path that lists it
        assert expected > 3000
        seen = tmp_path / str(len(paths) + expected)
        seen.mkdir()
        counter = CountRows(str(seen))
        model = linear_estimator(maxEpochs=1, batchSize=32, hooks=[counter]).fit(df)
        assert counter.totals()[0] == expected
        assert model.transform(df).count() == expected


def test_a_table_spark_refuses_is_refused_naming_the_file_and_not_retried(spark, table, tmp_path, caplog):
    """One file holds the label as int64, another as double: pyarrow would read both, Spark
    refuses; and a file whose footer is cut off after the DataFrame was made."""
    mixed = str(tmp_path / "mixed")
    df = spark.read.parquet(table)
    df.limit(100).withColumn("label", F.col("label").cast("long")).coalesce(1).write.parquet(mixed)
    df.limit(100).coalesce(1).write.mode("append").parquet(mixed)
    mixed_df = spark.read.parquet(mixed)
    assert _source(mixed_df) is None

    cut = str(tmp_path / "cut")
    df.repartition(2).write.parquet(cut)
    cut_df = spark.read.parquet(cut)
    victim = sorted(p for p in os.listdir(cut) if p.endswith(".parquet"))[-1]
    with open(os.path.join(cut, victim), "r+b") as handle:
        handle.truncate(os.path.getsize(os.path.join(cut, victim)) - 10)

    for frame, name in ((mixed_df, "part-"), (cut_df, victim)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="spark_torch_est"):
            with pytest.raises(InputDataError, match=f"Spark cannot read the training table: .*{name}"):
                linear_estimator(maxEpochs=1, maxRetries=1).fit(frame)
        assert not any(r.getMessage().startswith("relaunching") for r in caplog.records)


def test_a_file_rewritten_with_the_same_size_and_mtime_is_read_again(spark, tmp_path):
    """A worker keeps the part it read for the next fit: not after its file was rewritten."""
    path = str(tmp_path / "table.parquet")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8))
    plain = dict(compression="none", use_dictionary=False, write_statistics=False)

    def write(y):
        pq.write_table(pa.table({"features": pa.array(list(x)), "label": y}), path, **plain)

    write(x @ np.arange(8.0))
    stat = os.stat(path)
    (tmp_path / "seen").mkdir()
    counter = CountRows(str(tmp_path / "seen"), epoch=1)
    est = linear_estimator(maxEpochs=2, numWorkers=1, hooks=[counter])  # one rank: the same Python worker
    est.fit(spark.read.parquet(path), duration="1ep")
    new = -x @ np.arange(8.0)
    write(new)  # the same size and footer, the labels negated
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.path.getsize(path) == stat.st_size
    est.fit(spark.read.parquet(path))
    rows, total = counter.totals()
    assert rows == 512 and total == pytest.approx(new.sum(), rel=1e-4)  # the new labels, not the kept ones
