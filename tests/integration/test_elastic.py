"""Elastic runs on local[2]: a launch that finds fewer slots than numWorkers but at least
minWorkers trains with the slots there are and keeps the global batch (the lost-worker
cases on local-cluster and standalone are in test_cluster.py)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from spark_torch_est.errors import InvalidInputError
from tests.helpers import RecordRows, linear_estimator, recorded_rows, spark_jobs_started

pytestmark = pytest.mark.spark


def test_fewer_slots_than_num_workers_train_on_the_slots_with_the_global_batch(spark, linear_df, linear_data,
                                                                               tmp_path, caplog):
    shrunk = linear_estimator(numWorkers=3, minWorkers=2, batchSize=64, maxEpochs=2, seed=4,
                              hooks=[RecordRows(str(tmp_path))])
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        shrunk.fit(linear_df)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("only 2 of numWorkers=3 task slots are free" in w and "training on 2 ranks (minWorkers=2)" in w
               for w in warnings), warnings
    assert any("on 2 of numWorkers=3 ranks (96 rows per rank per step)" in r.getMessage() for r in caplog.records)
    # two ranks of 96 rows: the optimizer steps of three ranks of 64, every row once per epoch
    assert [e["world_size"] for e in shrunk.history] == [2, 2]
    assert shrunk.progress.global_step == 2 * math.ceil(3000 / (3 * 64))
    labels = np.sort(linear_data[1].astype(np.float32))
    for epoch, worlds in recorded_rows(str(tmp_path)).items():
        assert list(worlds) == [2]
        assert np.array_equal(worlds[2]["labels"], labels), epoch
        assert sorted(worlds[2]["batches"].tolist()) == [60] * 2 + [96] * 30  # 1500 rows a rank
    assert shrunk.history[-1]["train_loss"] < shrunk.history[0]["train_loss"]
    # the same as a plain 2-rank run with 96 rows per rank, bitwise
    plain = linear_estimator(numWorkers=2, batchSize=96, maxEpochs=2, seed=4)
    plain.fit(linear_df)
    for key, value in plain.checkpoint.model_state.items():
        assert torch.equal(value, shrunk.checkpoint.model_state[key]), key


def test_without_min_workers_too_few_slots_stay_a_clear_error(spark, linear_df):
    jobs = spark_jobs_started(spark)
    est = linear_estimator(numWorkers=3, minWorkers=3)
    with pytest.raises(InvalidInputError, match=r"numWorkers=3 needs 3 task slots at once, but the cluster offers 2"):
        est.fit(linear_df)
    est = linear_estimator(numWorkers=4, minWorkers=3)
    with pytest.raises(InvalidInputError, match=r"numWorkers=4 minWorkers=3 needs 3 task slots at once, but the "
                                                r"cluster offers 2 .*lower numWorkers or minWorkers"):
        est.fit(linear_df)
    assert est.checkpoint is None and spark_jobs_started(spark) == jobs, "refused before any Spark job"
