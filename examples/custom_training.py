"""A custom training step (gradient accumulation + clipping) with early stopping.

A Hook's ``train_step`` replaces the loop's forward/backward/optimizer step: here each
batch is split into 4 micro-batches whose gradients are accumulated (DDP synchronizes
only on the last one), clipped, and applied in one optimizer step. EarlyStopping watches
the validation loss (rows where ``is_val`` is True); Throughput adds samples/s.

Runs with `python examples/custom_training.py` or `spark-submit examples/custom_training.py`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import torch
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from torch.nn.parallel import DistributedDataParallel

from spark_torch_est import EarlyStopping, Hook, Throughput, TorchEstimator

# Executors must run a Python that has torch; by default the one running this script.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


class AccumulateAndClip(Hook):
    """One optimizer step per batch, from the gradients of ``micro_batches`` slices."""

    def __init__(self, micro_batches: int = 4, max_norm: float = 1.0) -> None:
        self.micro_batches, self.max_norm = micro_batches, max_norm

    def train_step(self, model, batch, loss_fn, optimizer):
        # `model` is DDP-wrapped when numWorkers > 1: call it, not the plain module.
        inputs, labels = batch
        optimizer.zero_grad(set_to_none=True)
        parts = list(zip(inputs.chunk(self.micro_batches), labels.chunk(self.micro_batches)))
        total = inputs.new_zeros(())
        for i, (x, y) in enumerate(parts):
            last = i == len(parts) - 1
            # DDP all-reduces gradients in every backward; defer that to the last micro-batch.
            deferred = isinstance(model, DistributedDataParallel) and not last
            sync = model.no_sync() if deferred else contextlib.nullcontext()
            with sync:
                loss = loss_fn(model(x), y) * (len(x) / len(inputs))  # weighted: sums to the batch mean
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm)
        optimizer.step()
        return total  # the batch's mean loss, recorded as train_loss


def make_model(config: dict) -> torch.nn.Module:
    d, h = config["features"], config["hidden"]
    return torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(),
                               torch.nn.Linear(h, 1))


def make_optimizer(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=config["lr"])


def make_data(spark: SparkSession, rows: int = 2_000, features: int = 32):
    """A small, noisy regression set (so the MLP overfits) with ~25% validation rows."""
    df = spark.range(rows).select(
        F.array(*[F.randn(seed=i).cast("float") for i in range(features)]).alias("features"),
        (F.rand(seed=7) < 0.25).alias("is_val"),
    )
    x = F.col("features")
    return df.withColumn("label", x[0] - 0.5 * x[1] + x[2] * x[3] + 0.5 * F.randn(seed=99))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # local[*] unless spark-submit --master or conf/spark-defaults.conf names another master
    spark = SparkSession.builder.appName("spark_torch_est custom training").getOrCreate()
    df = make_data(spark).cache()

    stopper = EarlyStopping(monitor="val_loss", patience=2)
    est = TorchEstimator(
        model=make_model, optimizer=make_optimizer, loss=torch.nn.MSELoss(),
        config={"features": 32, "hidden": 128, "lr": 3e-3},
        hooks=[AccumulateAndClip(micro_batches=4, max_norm=1.0), stopper, Throughput()],
        validationIndicatorCol="is_val", batchSize=64, maxEpochs=30,
        numWorkers=min(2, spark.sparkContext.defaultParallelism), seed=0, showProgress=False,
    )
    est.fit(df)

    print("\nhistory:")
    for entry in est.history:
        print(f"  epoch {entry['epoch']:2d}: train_loss {entry['train_loss']:.4f}  "
              f"val_loss {entry['val_loss']:.4f}  samples_per_s {entry['samples_per_s']:,.0f}")
    # The driver's hook objects hold rank 0's hook state once fit() returns.
    if stopper.stopped_epoch is not None:
        print(f"\nearly stopping ended the run after epoch {stopper.stopped_epoch} of {est.getMaxEpochs()} "
              f"(best val_loss {stopper.best:.4f}); {est.progress}")
    else:
        print(f"\nno early stop: trained all {est.getMaxEpochs()} epochs; {est.progress}")
    spark.stop()


if __name__ == "__main__":
    main()
