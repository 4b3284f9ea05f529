"""A LightningModule, as written for ``pl.Trainer``, fitted on a DataFrame unchanged.

The module logs with ``self.log`` (averaged over the ranks with ``sync_dist``), validates on
the rows where ``is_val`` is True, and returns Adam with a StepLR scheduler dict from
``configure_optimizers``; Lightning's ``EarlyStopping`` and ``LearningRateMonitor`` come in
``callbacks=``, other Trainer settings in ``trainerArgs=``. The run continues across fits
(two epochs, then the rest), and the fitted model scores the DataFrame with the module's
``forward``. Needs the ``lightning`` extra: ``pip install 'spark-torch-est[lightning]'``.

Runs with `python examples/lightning_module.py` or `spark-submit examples/lightning_module.py`.
"""

from __future__ import annotations

import logging
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_torch_est import TorchEstimator

# Executors must run a Python that has torch; by default the one running this script.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


class Regressor(pl.LightningModule):
    """An MLP regressor in Lightning's style."""

    def __init__(self, features: int = 16, hidden: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).squeeze(-1), y)
        self.log("mse", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_mse", torch.nn.functional.mse_loss(self(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def make_data(spark: SparkSession, rows: int = 2_000, features: int = 16):
    """A noisy regression set with ~20% validation rows."""
    df = spark.range(rows).select(
        F.array(*[F.randn(seed=i).cast("float") for i in range(features)]).alias("features"),
        (F.rand(seed=7) < 0.2).alias("is_val"),
    )
    x = F.col("features")
    return df.withColumn("label", (x[0] - 0.5 * x[1] + x[2] * x[3] + 0.1 * F.randn(seed=99)).cast("float"))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # local[*] unless spark-submit --master or conf/spark-defaults.conf names another master
    spark = SparkSession.builder.appName("spark_torch_est lightning").getOrCreate()
    df = make_data(spark).cache()

    est = TorchEstimator(
        model=Regressor(), callbacks=[EarlyStopping(monitor="val_mse", patience=3), LearningRateMonitor()],
        trainerArgs={"gradient_clip_val": 1.0, "num_sanity_val_steps": 0},
        validationIndicatorCol="is_val", batchSize=64, maxEpochs=12,
        numWorkers=min(2, spark.sparkContext.defaultParallelism), seed=0, showProgress=False,
    )
    est.fit(df, duration="2ep")  # two epochs, then the rest of the run: as one fit of 12 epochs
    model = est.fit(df)
    for entry in est.history:
        print(f"epoch {entry['epoch']:2d}  mse {entry['mse']:.4f}  val_mse {entry['val_mse']:.4f}  "
              f"lr {entry['lr-Adam']:.5f}")
    model.transform(df).select("label", "prediction").show(5)
    held_out = model.evaluate(df.where("is_val"))  # validation_step over those rows, as pl.Trainer.validate
    print(f"val_mse over the validation rows: {held_out['val_mse']:.4f}")
    assert est.history[-1]["val_mse"] < est.history[0]["val_mse"], "the module should have learned"
    spark.stop()


if __name__ == "__main__":
    main()
