"""Run by test_cluster.py: a LightningModule's elastic fit (minWorkers) on a standalone master
with two one-core workers (``OUT MASTER``): an undisturbed fit, then one in which a callback
kills rank 1's whole worker (SIGKILL) in the middle of epoch 2, so that the run goes on on the
rank left."""

import json
import logging
import os
import sys
import time

import lightning.pytorch as pl
import numpy as np
import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import TorchEstimator  # noqa: E402
from tests.helpers import descendants, worker_jvm  # noqa: E402

out_dir, master = sys.argv[1], sys.argv[2]
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
logging.getLogger("spark_torch_est.fit").setLevel(logging.INFO)


class Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).squeeze(-1), y)
        self.log("mse", loss, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}


class KillWorkerOnce(pl.Callback):
    """SIGKILLs rank 1's whole worker (its JVM, its executor JVM, their Python processes) after
    batch 5 of epoch 2, the first time only; records when, in ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.current_epoch == 1 and batch_idx == 5 and not os.path.exists(
                self.marker):
            worker = worker_jvm(os.getpid())
            victims = [worker, *sorted(descendants(worker) - {os.getpid()})]
            with open(self.marker, "w") as f:
                json.dump({"time": time.time(), "killed": victims}, f)
            for pid in victims:
                os.kill(pid, 9)
            os.kill(os.getpid(), 9)


class RecordRows(pl.Callback):
    """Saves the labels each rank trained on in each completed epoch to
    ``<directory>/e<epoch>-w<world_size>-r<rank>.npz`` (tests.helpers.recorded_rows reads them)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.labels: list[np.ndarray] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.labels = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.labels.append(batch[1].detach().cpu().numpy().ravel())

    def on_train_epoch_end(self, trainer, pl_module):
        labels = np.concatenate(self.labels) if self.labels else np.zeros(0)
        np.savez(os.path.join(self.directory, f"e{trainer.current_epoch + 1}-w{trainer.world_size}-"
                                              f"r{trainer.global_rank}.npz"),
                 labels=labels, batches=np.array([len(part) for part in self.labels]))


def estimator(**params) -> TorchEstimator:
    return TorchEstimator(**{**dict(model=Linear(), batchSize=32, maxEpochs=4, numWorkers=2, seed=3,
                                    showProgress=False), **params})


spark = (SparkSession.builder.config("spark.ui.enabled", "false").master(master)
         .config("spark.executor.cores", "1").config("spark.cores.max", "2").config("spark.executor.memory", "1g")
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
rng = np.random.default_rng(1)
x = rng.normal(size=(2000, 8))
w = rng.normal(size=8)
labels = x @ w + 0.5
np.save(os.path.join(out_dir, "labels.npy"), labels.astype(np.float32))
rows = spark.sparkContext.parallelize([(r.tolist(), float(t)) for r, t in zip(x, labels)], 3)
df = spark.createDataFrame(rows, "features array<double>, label double").cache()
df.count()


def summary(est: TorchEstimator) -> dict:
    weights = est.checkpoint.model_state["layer.weight"].numpy().ravel()
    return {"history": est.history, "global_step": est.progress.global_step,
            "lightning_step": est.checkpoint.lightning_state["global_step"],
            "weight_error": float(np.abs(weights - w).max())}


result = {}
undisturbed = estimator(slotWaitTimeout=120.0)  # both executors register first
undisturbed.fit(df)
result["undisturbed"] = summary(undisturbed)
os.makedirs(os.path.join(out_dir, "rows"))
elastic = estimator(minWorkers=1, maxRetries=2, slotWaitTimeout=10.0, checkpointDir=os.path.join(out_dir, "ckpt"),
                    callbacks=[KillWorkerOnce(os.path.join(out_dir, "killed.json")),
                               RecordRows(os.path.join(out_dir, "rows"))])
elastic.fit(df)
result["elastic"] = summary(elastic)
result["kill"] = json.load(open(os.path.join(out_dir, "killed.json")))
print("RESULT " + json.dumps(result))
spark.stop()
