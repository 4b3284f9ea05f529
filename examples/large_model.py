"""Train a model sharded across the workers (strategy="fsdp"), resume it with another
numWorkers, then score with the gathered full model.

Each rank holds about 1/numWorkers of the weights and of Adam's state; checkpoints are
written by every rank into checkpointDir (storage every worker reaches: here a local
folder, since local[2] runs on one machine). Runs with `python examples/large_model.py`
and with `spark-submit examples/large_model.py`. See docs/large-models.md.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_torch_est import TorchEstimator

# Executors must run a Python that has torch; by default the one running this script.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


class Block(torch.nn.Module):
    """A residual MLP block: the unit each rank shards on its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def make_model(config: dict) -> torch.nn.Module:
    width = config["width"]
    return torch.nn.Sequential(torch.nn.Linear(config["features"], width),
                               *[Block(width) for _ in range(config["blocks"])], torch.nn.Linear(width, 1))


def make_optimizer(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=config["lr"])


def main() -> None:
    spark = SparkSession.builder.appName("large_model").getOrCreate()
    features = 16
    df = spark.range(8000).select(F.array(*[F.randn(seed=i).cast("float") for i in range(features)]).alias("features"))
    df = df.withColumn("label", F.sin(F.col("features")[0]) + F.col("features")[1] * F.col("features")[2])
    checkpoints = tempfile.mkdtemp(prefix="spark_torch_est-fsdp-")
    est = TorchEstimator(model=make_model, optimizer=make_optimizer, loss=torch.nn.MSELoss(),
                         config={"features": features, "width": 128, "blocks": 4, "lr": 1e-3},
                         batchSize=128, maxEpochs=4, numWorkers=2, strategy="fsdp", shardModules=["Block"],
                         checkpointDir=checkpoints, showProgress=False)
    est.fit(df, duration="2ep")
    print(f"2 epochs on 2 workers, checkpoints in {checkpoints}: {sorted(os.listdir(checkpoints))}")
    est.setNumWorkers(1)  # the sharded checkpoint reshards on load
    model = est.fit(df)
    for entry in est.history:
        print(f"epoch {entry['epoch']:2d}: train_loss {entry['train_loss']:.4f}")
    print(f"evaluate: {model.evaluate(df)}")
    print(f"the full model, gathered: {sum(p.numel() for p in model.torch_model().parameters())} parameters")
    spark.stop()


if __name__ == "__main__":
    main()
