"""Twenty fits in one SparkSession leave no leaked threads, descriptors, processes or memory."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from spark_torch_est import TorchEstimator
from tests.helpers import descendants, linear_model, sgd

pytestmark = pytest.mark.spark


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(text for text in f if text.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _measure() -> dict[str, float]:
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "processes": len(descendants(os.getpid())), "rss_mb": _rss_mb(),
            "fit_threads": len([t for t in threading.enumerate()  # the kept rows' watcher lives between fits
                          if t.name.startswith("spark_torch_est") and t.name != "spark_torch_est-kept-watch"])}


def test_twenty_fits_in_a_row_leak_nothing(spark, linear_df):
    est = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), batchSize=256,
                         maxEpochs=40, numWorkers=2, showProgress=False)
    samples = []
    for _ in range(20):
        est.fit(linear_df, duration="1ep")
        samples.append(_measure())
    print("soak:", samples[1], "->", samples[-1])
    first, last = samples[1], samples[-1]
    assert est.progress.epoch == 20
    assert all(sample["fit_threads"] == 0 for sample in samples), \
        "a fit returns once its channel and store threads ended"
    assert last["threads"] <= first["threads"] + 2
    assert last["fds"] <= first["fds"] + 8
    assert last["processes"] <= first["processes"]
    assert last["rss_mb"] - samples[4]["rss_mb"] < 60
