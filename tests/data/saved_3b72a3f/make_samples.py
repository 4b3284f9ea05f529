"""Writes the saved samples beside this file, as the release before the move to folders
by concept saved them. Must be run against commit 3b72a3f, not the current code:

    git worktree add /tmp/old3b72 3b72a3f
    PYTHONPATH=/tmp/old3b72 python tests/data/saved_3b72a3f/make_samples.py

It saves a TorchEstimator stopped after 2 of its 4 epochs (``estimator/``, with an
EarlyStopping hook and a CSVLogger, so their old module paths are pickled, and the run's
newest checkpoint in ``checkpoints/``; one rank, as a checkpoint holds ~50 KB of RNG
state per rank), the TorchModel of that fit (``model/``), the input rows
(``rows.json``) and what the old code predicted for them after 2 epochs and after
continuing the run to 4 (``predictions.json``). tests/integration/test_saved_by_earlier_release.py
loads them with the current code.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from pyspark.sql import SparkSession

import spark_torch_est
from spark_torch_est import CSVLogger, EarlyStopping, TorchEstimator, TorchModel

HERE = os.path.dirname(os.path.abspath(__file__))


def model(config: dict) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def optimizer(module: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=config["lr"])


def rows() -> list[dict]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(48, 3))
    y = x @ np.array([0.5, -1.0, 2.0]) + 0.25
    return [{"id": i, "features": [float(v) for v in r], "label": float(t)} for i, (r, t) in enumerate(zip(x, y))]


def predictions(fitted: TorchModel, df) -> list[float]:
    return [r.prediction for r in fitted.transform(df).orderBy("id").select("prediction").collect()]


def main() -> None:
    if "/old3b72/" not in spark_torch_est.__file__ and os.environ.get("SAMPLES_ANY_CODE") != "1":
        sys.exit(f"run this against commit 3b72a3f (PYTHONPATH=<its worktree>), not {spark_torch_est.__file__}")
    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    workdir = tempfile.mkdtemp()
    os.chdir(workdir)  # the CSVLogger's relative log_dir lands here, not in the samples
    try:
        for name in ("estimator", "model", "checkpoints"):
            shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
        data = rows()
        df = spark.createDataFrame(data).select("id", "features", "label")
        est = TorchEstimator(model=model, optimizer=optimizer, loss=torch.nn.MSELoss(), config={"lr": 0.05},
                             hooks=[EarlyStopping(monitor="train_loss", patience=10)], loggers=[CSVLogger("csv_logs")],
                             batchSize=8, maxEpochs=4, numWorkers=1, seed=7, showProgress=False,
                             checkpointDir=os.path.join(HERE, "checkpoints"))
        half = est.fit(df, duration="2ep")
        for name in os.listdir(os.path.join(HERE, "checkpoints")):  # only the newest point: a checkpoint
            if "-ep000001-" in name:                                # holds each rank's RNG states (~50 KB)
                os.remove(os.path.join(HERE, "checkpoints", name))
        est.save(os.path.join(HERE, "estimator"))
        half.save(os.path.join(HERE, "model"))
        after_two = predictions(half, df)
        continued = TorchEstimator.load(os.path.join(HERE, "estimator"))  # the run's later points stay out of
        continued.setCheckpointDir(os.path.join(workdir, "checkpoints"))   # the saved checkpointDir
        after_four = predictions(continued.fit(df), df)
        with open(os.path.join(HERE, "rows.json"), "w") as f:
            json.dump(data, f)
        with open(os.path.join(HERE, "predictions.json"), "w") as f:
            json.dump({"epoch2": after_two, "epoch4": after_four}, f)
    finally:
        spark.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
