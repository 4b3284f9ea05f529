"""The core promise: a DataFrame in, a trained DDP model out, in any feature layout."""

from __future__ import annotations

import logging
import os
import re
import tempfile

import numpy as np
import pytest
import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F

from spark_torch_est import Hook, TorchModel
from tests.helpers import DumpWeights, linear_estimator

pytestmark = pytest.mark.spark


#: This module's estimator: tests.helpers.linear_estimator with these settings.
SETTINGS = {"batchSize": 32}


def _assert_learned(model: TorchModel, w: np.ndarray, b: float) -> None:
    module = model.torch_model()
    np.testing.assert_allclose(module.weight.detach().numpy().ravel(), w, atol=0.05)
    assert abs(module.bias.item() - b) < 0.05


@pytest.mark.compat
def test_array_features_learn_linear_target_and_ranks_agree(spark, linear_df, linear_data, tmp_path):
    x, y, w, b = linear_data
    model = linear_estimator(SETTINGS, hooks=[DumpWeights(str(tmp_path))]).fit(linear_df)

    _assert_learned(model, w, b)
    rank0, rank1 = np.load(tmp_path / "rank0.npy"), np.load(tmp_path / "rank1.npy")
    np.testing.assert_array_equal(rank0, rank1)
    predictions = model.transform(linear_df).select("label", "prediction").toPandas()
    rmse = float(np.sqrt(((predictions["label"] - predictions["prediction"]) ** 2).mean()))
    assert rmse < 0.02
    assert len(predictions) == len(x)


@pytest.mark.compat
def test_the_fits_debug_log_says_where_rank_0s_launch_went(spark, linear_df, caplog):
    with caplog.at_level(logging.DEBUG, logger="spark_torch_est.worker"):
        linear_estimator(maxEpochs=1).fit(linear_df, duration="1ba")
    (line,) = [r.getMessage() for r in caplog.records if "the launch took" in r.getMessage()]
    spent = dict(re.findall(r"(\w[\w ]*?) (\d+\.\d\d)s", line.split("the launch took ")[1]))
    assert set(spent) == {"rendezvous", "scan", "ingest", "layout", "setup", "first step"}, line
    assert line.startswith("[rank 0]")


def test_vector_features_dense_and_sparse(spark, linear_data):
    x, y, w, b = linear_data
    rows = [
        (Vectors.sparse(8, {j: float(v) for j, v in enumerate(row) if j % 2 == 0 or v > 0}) if i % 3 == 0
         else Vectors.dense(row.tolist()),
         float(row[np.arange(8)[(np.arange(8) % 2 == 0) | (row > 0)]] @ w[(np.arange(8) % 2 == 0) | (row > 0)] + b)
         if i % 3 == 0 else float(t))
        for i, (row, t) in enumerate(zip(x, y))
    ]
    df = spark.createDataFrame(rows, ["vec", "target"])
    model = linear_estimator(SETTINGS, featuresCol="vec", labelCol="target").fit(df)
    _assert_learned(model, w, b)
    assert model.transform(df).schema["prediction"].dataType.typeName() == "double"


def test_feature_columns(spark, wide_df, linear_data):
    _, _, w, b = linear_data
    model = linear_estimator(SETTINGS, featuresCol=None, featureCols=[f"f{i}" for i in range(8)]).fit(wide_df)
    _assert_learned(model, w, b)
    assert "prediction" in model.transform(wide_df).columns


def test_uneven_partitions_train_without_hanging(spark, linear_data):
    x, y, w, b = linear_data
    rows = [(r.tolist(), float(t)) for r, t in zip(x, y)]
    parts = spark.sparkContext.parallelize([0, 1], 2).flatMap(lambda i: rows[:2800] if i == 0 else rows[2800:])
    uneven = spark.createDataFrame(parts, "features array<double>, label double")
    assert uneven.rdd.glom().map(len).collect() == [2800, 200]

    est = linear_estimator(SETTINGS, timeout=120, hooks=[CountRows()])
    model = est.fit(uneven)

    _assert_learned(model, w, b)
    # no shuffle, yet the ranks evened out their rows: 1500 each, every row once per epoch
    assert est.progress.global_step == 4 * int(np.ceil(1500 / 32))
    assert est.progress.samples == 4 * 3000
    assert est.hooks["CountRows"].rows == {0: 1500, 1: 1500}


class CountRows(Hook):
    """Counts the training rows each rank saw in its first epoch (kept in hook state)."""

    def __init__(self):
        self.rows = {}
        self._seen = 0

    def after_train_iter(self, inputs, epoch, rank, world_size):
        if epoch == 0:
            self._seen += len(inputs)

    def after_train_epoch(self, epoch, rank, world_size):
        if epoch == 1:
            counts = torch.zeros(world_size, dtype=torch.int64)
            counts[rank] = self._seen
            torch.distributed.all_reduce(counts)
            self.rows = {r: int(n) for r, n in enumerate(counts)}

    def state_dict(self):
        return {"rows": self.rows}

    def load_state_dict(self, state):
        self.rows = state["rows"]


def test_scalar_label_is_shaped_like_a_single_output(spark, linear_df):
    est = linear_estimator(SETTINGS, maxEpochs=1)
    est.fit(linear_df)
    # a broadcasting (B,) vs (B, 1) MSELoss would settle near the label variance, not near 0
    assert est.history[0]["train_loss"] < 1.0
    assert est.checkpoint.output_shape == [1]


def test_multi_output_prediction_is_an_array(spark, linear_df):
    est = linear_estimator(SETTINGS, model=lambda c: torch.nn.Linear(8, 3),
                     loss=lambda out, y: ((out - y) ** 2).mean(), maxEpochs=1)
    two_labels = linear_df.withColumn("label", F.array("label", "label", "label"))
    model = est.fit(two_labels)
    row = model.transform(two_labels).select("prediction").first()
    assert len(row.prediction) == 3


class SpillFiles(Hook):
    """Writes to ``<directory>/rank<r>`` how many spill files rank ``r`` trains from: the
    deleted files under Spark's local directory its process holds open at its first step."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def after_train_iter(self, rank, global_step):
        if global_step != 1:
            return
        local = os.environ.get("SPARK_LOCAL_DIRS", tempfile.gettempdir()).split(",")[0]
        targets = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
        with open(os.path.join(self.directory, f"rank{rank}"), "w") as out:
            out.write(str(sum(t.startswith(local) and t.endswith("(deleted)") for t in targets)))


def _spill_files(directory) -> list[int]:
    return [int((directory / f"rank{rank}").read_text()) for rank in range(2)]


@pytest.mark.compat
def test_a_partition_over_the_memory_budget_spills_and_trains_identically(spark, linear_df, tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "spilled").mkdir()
    in_memory = linear_estimator(SETTINGS, maxEpochs=2, memoryBudgetMB=0, hooks=[SpillFiles(str(tmp_path / "memory"))])
    in_memory.fit(linear_df)
    spilled = linear_estimator(SETTINGS, maxEpochs=2, memoryBudgetMB=0.02,  # 20 KB: each rank's ~50 KB partition
                               hooks=[SpillFiles(str(tmp_path / "spilled"))])
    spilled.fit(linear_df)
    assert _spill_files(tmp_path / "memory") == [0, 0]
    assert min(_spill_files(tmp_path / "spilled")) >= 1, "every rank trained from rows spilled to a file"
    for key, value in in_memory.checkpoint.model_state.items():
        assert torch.equal(value, spilled.checkpoint.model_state[key])


@pytest.mark.compat
@pytest.mark.parametrize("shape", ["coalesce", "union"])
def test_dataframes_a_barrier_stage_refuses_as_they_are_still_train(spark, linear_df, linear_data, shape):
    """coalesce() and union() chains with numWorkers partitions are repartitioned, not launched as they are."""
    x, y, w, b = linear_data
    rows, schema = [(r.tolist(), float(t)) for r, t in zip(x, y)], "features array<double>, label double"
    if shape == "coalesce":
        df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 4), schema).coalesce(2)
    else:
        half = len(rows) // 2
        df = spark.createDataFrame(spark.sparkContext.parallelize(rows[:half], 1), schema).union(
            spark.createDataFrame(spark.sparkContext.parallelize(rows[half:], 1), schema))
    assert df.rdd.getNumPartitions() == 2
    _assert_learned(linear_estimator(SETTINGS, maxEpochs=6).fit(df), w, b)
