"""A Wide & Deep click model on typed columns: int64 ids into embeddings beside dense floats.

Synthetic clicks: every user and item has a hidden taste vector, and a click is more
likely when they agree, plus a little from three dense features. `inputCols` hands the
model the two id columns as int64 (ids above 2**24 stay exact: they are never cast to
float) and the dense columns as float32, so the model is called as
``model(user_id, item_id, dense)``. Prints the test AUC from Spark's evaluator.

Runs with `python examples/recommender.py` or `spark-submit examples/recommender.py`.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from pyspark.ml.evaluation import BinaryClassificationEvaluator
from pyspark.sql import SparkSession
from torch import nn

from spark_torch_est import TorchEstimator

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
USERS, ITEMS, ID_BASE = 100, 50, 10 ** 12  # ids far above 2**24


class WideAndDeep(nn.Module):
    """Embeddings of the ids (deep, with their dot product) beside a linear part on the dense features (wide)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        dim = config["dim"]
        self.users, self.items = nn.Embedding(config["users"], dim), nn.Embedding(config["items"], dim)
        self.deep = nn.Sequential(nn.Linear(2 * dim + 3, 32), nn.ReLU(), nn.Linear(32, 1))
        self.wide = nn.Linear(3, 1)

    def forward(self, user_id: torch.Tensor, item_id: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        user = self.users(user_id - ID_BASE)  # int64 ids, exact
        item = self.items(item_id - ID_BASE)
        deep = self.deep(torch.cat([user, item, dense], dim=1))
        return deep + self.wide(dense) + (user * item).sum(1, keepdim=True)


def clicks(spark: SparkSession, rows: int = 40_000, seed: int = 0):
    rng = np.random.default_rng(seed)
    taste_u, taste_i = rng.normal(size=(USERS, 4)), rng.normal(size=(ITEMS, 4))
    user, item = rng.integers(0, USERS, rows), rng.integers(0, ITEMS, rows)
    dense = rng.normal(size=(rows, 3)).astype(np.float32)
    logit = (taste_u[user] * taste_i[item]).sum(1) + dense @ np.array([0.5, -0.5, 0.25])
    clicked = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(float)
    data = [(int(ID_BASE + u), int(ID_BASE + i), d.tolist(), float(c))
            for u, i, d, c in zip(user, item, dense, clicked)]
    return spark.createDataFrame(data, "user_id long, item_id long, dense array<float>, clicked double")


def main() -> None:
    # local[*] unless spark-submit --master or conf/spark-defaults.conf names another master
    spark = SparkSession.builder.appName("spark_torch_est recommender").getOrCreate()
    train, test = clicks(spark).randomSplit([0.8, 0.2], seed=1)
    est = TorchEstimator(
        model=WideAndDeep, optimizer=lambda model, config: torch.optim.Adam(model.parameters(), lr=config["lr"]),
        loss=nn.BCEWithLogitsLoss(), config={"users": USERS, "items": ITEMS, "dim": 4, "lr": 0.02},
        inputCols=["user_id", "item_id", "dense"], labelCol="clicked",
        batchSize=256, maxEpochs=10, numWorkers=min(2, spark.sparkContext.defaultParallelism), seed=0,
        showProgress=False,
    )
    model = est.fit(train.cache())
    for entry in est.history:
        print(f"epoch {entry['epoch']}: train_loss {entry['train_loss']:.4f}")
    scored = model.transform(test)  # prediction: the click logit
    auc = BinaryClassificationEvaluator(labelCol="clicked", rawPredictionCol="prediction").evaluate(scored)
    print(f"test AUC {auc:.3f} (ids up to {ID_BASE + USERS}, kept exact as int64)")
    spark.stop()


if __name__ == "__main__":
    main()
