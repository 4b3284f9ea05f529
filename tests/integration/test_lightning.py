"""A LightningModule fits unchanged: Lightning's own loop on every rank, checked against a
``pl.Trainer`` run of the same module on the same batches (docs/lightning.md)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra (pip install '.[lightning]')")

from spark_torch_est import TorchEstimator, TorchModel  # noqa: E402

pytestmark = pytest.mark.spark

ROWS, WIDTH, BATCH = 256, 4, 32


class Regressor(pl.LightningModule):
    """A linear regression in Lightning's style: Adam with a StepLR dict, self.log with
    on_step/on_epoch/sync_dist, a validation_step; records the batches it trains on when
    ``record`` names a folder."""

    def __init__(self, lr: float = 0.05, record: str | None = None, scheduler: str = "step") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(WIDTH, 1)
        self.lr, self.record, self.scheduler = lr, record, scheduler
        self.seen_epochs: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).squeeze(-1), y)
        self.log("loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log_dict({"rank_seen": float(self.global_rank)}, on_step=False, on_epoch=True, sync_dist=True)
        if self.record is not None:
            name = f"e{self.current_epoch}-s{self.global_step}-r{self.global_rank}.pt"
            torch.save({"x": x, "y": y}, os.path.join(self.record, name))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", torch.nn.functional.mse_loss(self(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.scheduler == "none":
            return optimizer
        if self.scheduler == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "loss"}}
        step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": step, "interval": "step", "frequency": 2}}


@pytest.fixture(scope="module")
def lit_df(spark):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, WIDTH)).astype(np.float32)
    y = (x @ np.arange(1, WIDTH + 1, dtype=np.float32) + 0.25).astype(np.float32)
    return spark.createDataFrame([(row.tolist(), float(t)) for row, t in zip(x, y)], ["features", "label"])


def lit_estimator(module, **params) -> TorchEstimator:
    settings = dict(model=module, batchSize=BATCH, maxEpochs=3, numWorkers=2, showProgress=False,
                    trainerArgs={"num_sanity_val_steps": 0})
    return TorchEstimator(**{**settings, **params})


def test_fit_trains_the_module(lit_df):
    est = lit_estimator(Regressor())
    model = est.fit(lit_df)
    history = est.history
    assert [entry["epoch"] for entry in history] == [1, 2, 3]
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[0]["rank_seen"] == pytest.approx(0.5)  # the ranks' values averaged (sync_dist)
    assert isinstance(model, TorchModel)
