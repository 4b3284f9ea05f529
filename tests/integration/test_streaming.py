"""transform on a Structured Streaming DataFrame scores each micro-batch as the batch
transform scores the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F

from spark_torch_est import TorchEstimator
from spark_torch_est.errors import InvalidInputError
from tests.helpers import linear_estimator, spark_jobs_started

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def classifier_and_files(spark, wide_df, tmp_path_factory):
    """A two-class model on featureCols, and its rows as two Parquet files."""
    names = [f"f{i}" for i in range(8)]
    df = wide_df.withColumn("label", (F.col("label") > 0).cast("int"))
    est = TorchEstimator(model=lambda c: torch.nn.Linear(8, 2), optimizer=lambda m, c: torch.optim.Adam(m.parameters()),
                         loss=torch.nn.CrossEntropyLoss(), featuresCol=None, featureCols=names, maxEpochs=1,
                         showProgress=False)
    directory = str(tmp_path_factory.mktemp("stream") / "rows")
    df.repartition(2).write.parquet(directory)
    return est.fit(df), directory


def _rows(df) -> list[tuple]:
    return [(r.id, r.prediction, tuple(r.probability.toArray())) for r in df.orderBy("id").collect()]


def test_memory_sink_gets_the_batch_transform(spark, classifier_and_files, tmp_path):
    model, directory = classifier_and_files
    batch = spark.read.parquet(directory)
    stream = spark.readStream.schema(batch.schema).option("maxFilesPerTrigger", 1).parquet(directory)
    query = (model.transform(stream).writeStream.format("memory").queryName("scored_stream")
             .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(availableNow=True).start())
    try:
        query.awaitTermination(120)
        assert query.exception() is None
        assert len(query.recentProgress) >= 2  # one micro-batch per file
        streamed = spark.table("scored_stream")
        assert streamed.columns == model.transform(batch).columns
        expected = _rows(model.transform(batch))
        assert len(expected) == 3000 and _rows(streamed) == expected
    finally:
        query.stop()
        spark.catalog.dropTempView("scored_stream")


def test_foreach_batch_sees_scored_micro_batches(spark, classifier_and_files, tmp_path):
    model, directory = classifier_and_files
    batch = spark.read.parquet(directory)
    stream = spark.readStream.schema(batch.schema).parquet(directory)
    seen: list[np.ndarray] = []

    def keep(micro_batch, batch_id):
        seen.append(np.array([(r.id, r.prediction) for r in micro_batch.select("id", "prediction").collect()]))

    query = (model.transform(stream).writeStream.foreachBatch(keep)
             .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(availableNow=True).start())
    try:
        query.awaitTermination(120)
        assert query.exception() is None
    finally:
        query.stop()
    got = np.concatenate(seen)
    got = got[np.argsort(got[:, 0])]
    expected = np.array([(r.id, r.prediction) for r in model.transform(batch).orderBy("id").collect()])
    np.testing.assert_array_equal(got, expected)


def test_fit_refuses_a_streaming_dataframe_before_any_job(spark, linear_df, tmp_path):
    directory = str(tmp_path / "rows")
    linear_df.write.parquet(directory)
    stream = spark.readStream.schema(linear_df.schema).parquet(directory)
    est, jobs = linear_estimator(), spark_jobs_started(spark)
    refusal = r"fit needs a static DataFrame, got a streaming one.*transform supports streaming.*foreachBatch"
    with pytest.raises(InvalidInputError, match=refusal):
        est.fit(stream)
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None and est.history == []
