"""Tune learning rate and width by successive halving: every configuration trains one epoch,
the better half goes on from where it stopped (never from scratch), and so on until one is
left, which trains to maxEpochs. Prints each rung and the winner.

Runs with `python examples/tune.py` (local[*] from conf/ or the default) and with
`spark-submit [--master ...] examples/tune.py`.
"""

from __future__ import annotations

import os
import sys

import cloudpickle
import torch
import train_regression  # the model, optimizer and data of examples/train_regression.py
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.tuning import ParamGridBuilder
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_torch_est import TorchEstimator
from spark_torch_est.tuning import SuccessiveHalving, param_map_name

# Executors must run a Python that has torch; by default the one running this script.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
# The creators come from our own module, which the executors do not have: ship them by value.
cloudpickle.register_pickle_by_value(train_regression)

LEARNING_RATES = [3e-4, 3e-3, 3e-2]
WIDTHS = [8, 64]


def main() -> None:
    spark = SparkSession.builder.appName("spark_torch_est tuning example").getOrCreate()
    df = train_regression.make_data(spark, rows=10_000).cache()
    train, test = df.randomSplit([0.9, 0.1], seed=1)

    est = TorchEstimator(
        model=train_regression.make_model, optimizer=train_regression.make_optimizer, loss=torch.nn.MSELoss(),
        batchSize=128, maxEpochs=6, numWorkers=min(2, spark.sparkContext.defaultParallelism), seed=0,
        showProgress=False,
    )
    configs = [{"features": 16, "hidden": width, "lr": lr} for width in WIDTHS for lr in LEARNING_RATES]
    grid = ParamGridBuilder().addGrid(est.getParam("config"), configs).build()
    tuner = SuccessiveHalving(estimator=est, estimatorParamMaps=grid, evaluator=RegressionEvaluator(metricName="rmse"),
                              eta=2, minDuration="1ep", seed=0, trainRatio=0.8)
    tuned = tuner.fit(train)

    print(f"\n{len(grid)} configurations, eta 2, from 1 epoch to maxEpochs {est.getMaxEpochs()}:")
    for rung in sorted({r["rung"] for r in tuned.rungs}):
        print(f"rung {rung}:")
        for r in (r for r in tuned.rungs if r["rung"] == rung):
            config = grid[r["index"]][est.config]
            print(f"  map {r['index']} (hidden {config['hidden']:>2}, lr {config['lr']:.0e}): {r['epochs']} epochs, "
                  f"validation RMSE {r['metric']:.4f}{'  kept' if r['kept'] else ''}")
    epochs = sum(max(r["epochs"] for r in tuned.rungs if r["index"] == i) for i in range(len(grid)))
    print(f"epochs trained in all: {epochs} (every configuration to maxEpochs: {len(grid) * est.getMaxEpochs()})")

    winner = tuned.rungs[-1]["index"]
    scored = tuned.transform(test)
    rmse = scored.select(F.sqrt(F.avg((F.col("label") - F.col("prediction")) ** 2))).first()[0]
    print(f"winner: map {winner} ({param_map_name(grid[winner])}), test RMSE {rmse:.4f}")
    spark.stop()


if __name__ == "__main__":
    main()
