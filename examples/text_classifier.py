"""A text classifier on token-id arrays of different lengths, with an EmbeddingBag.

Synthetic "documents": each of three topics favours its own part of a 300-word
vocabulary, and documents run from 3 to 40 tokens. The token arrays go in as they are
(`inputCols=["tokens"]`): each batch is padded only to its own longest document with
`paddingValue=0`, which the EmbeddingBag ignores (`padding_idx=0`). Integer labels and
three outputs make a classifier; prints the test accuracy from Spark's evaluator.

Runs with `python examples/text_classifier.py` or `spark-submit examples/text_classifier.py`.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.sql import SparkSession
from torch import nn

from spark_torch_est import TorchEstimator

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
VOCABULARY, TOPICS = 300, 3


class BagOfEmbeddings(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(VOCABULARY, config["dim"], mode="mean", padding_idx=0)
        self.out = nn.Linear(config["dim"], TOPICS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (batch, longest document in the batch), int64
        return self.out(self.embed(tokens))


def documents(spark: SparkSession, rows: int = 12_000, seed: int = 0):
    rng = np.random.default_rng(seed)
    topic = rng.integers(0, TOPICS, rows)
    data = []
    for t in topic:
        length = int(rng.integers(3, 41))
        own = rng.integers(1 + 100 * t, 1 + 100 * (t + 1) - 1, size=length)   # the topic's own words ...
        shared = rng.integers(1, VOCABULARY, size=length)                      # ... among common ones
        words = np.where(rng.random(length) < 0.5, own, shared)
        data.append(([int(w) for w in words], int(t)))
    return spark.createDataFrame(data, "tokens array<int>, topic int")


def main() -> None:
    # local[*] unless spark-submit --master or conf/spark-defaults.conf names another master
    spark = SparkSession.builder.appName("spark_torch_est text classifier").getOrCreate()
    train, test = documents(spark).randomSplit([0.8, 0.2], seed=1)
    est = TorchEstimator(
        model=BagOfEmbeddings, optimizer=lambda model, config: torch.optim.Adam(model.parameters(), lr=config["lr"]),
        loss=nn.CrossEntropyLoss(), config={"dim": 32, "lr": 0.01},
        inputCols=["tokens"], paddingValue=0, labelCol="topic",
        batchSize=128, maxEpochs=6, numWorkers=min(2, spark.sparkContext.defaultParallelism), seed=0,
        showProgress=False,
    )
    model = est.fit(train.cache())
    for entry in est.history:
        print(f"epoch {entry['epoch']}: train_loss {entry['train_loss']:.4f}")
    scored = model.transform(test)  # prediction: the class index; rawPrediction, probability: Vectors
    accuracy = MulticlassClassificationEvaluator(labelCol="topic", metricName="accuracy").evaluate(scored)
    print(f"test accuracy {accuracy:.3f} ({TOPICS} topics; documents of 3 to 40 tokens, padded per batch)")
    spark.stop()


if __name__ == "__main__":
    main()
