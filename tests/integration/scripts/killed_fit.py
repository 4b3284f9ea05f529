"""Run by test_cluster.py: one elastic fit (numWorkers=2, minWorkers=1, a checkpoint every
10 steps) on a standalone master with two one-core workers, during which a hook SIGKILLs
rank 1's whole worker (its process group) three times; the test restarts each 25 s later
(``OUT/killed-<i>.json`` says when it was killed, ``OUT/restarted-<i>`` that it is back).
Before it, the same fit undisturbed. A hook keeps every step's row ids, gathered across ranks."""

import json
import logging
import os
import sys
import time

import numpy as np
import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import Hook, TorchEstimator  # noqa: E402
from tests.helpers import StepRows, linear_model, sgd, worker_jvm  # noqa: E402

out_dir, master = sys.argv[1], sys.argv[2]
ROWS, KILLS_AT = 3000, (30, 130, 230)  # a kill at the first two-rank step past each
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
logging.getLogger("spark_torch_est.fit").setLevel(logging.INFO)


class KillWorkers(Hook):
    """On rank 1 of a two-rank job: SIGKILLs its worker's process group at the first step past
    each of ``KILLS_AT``, once the previous killed worker is back; records when."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def after_train_iter(self, rank, world_size, global_step):
        if rank != 1 or world_size != 2:
            return
        for i, at in enumerate(KILLS_AT):
            marker = os.path.join(self.directory, f"killed-{i}.json")
            if os.path.exists(marker):
                continue
            if global_step < at or (i and not os.path.exists(os.path.join(self.directory, f"restarted-{i - 1}"))):
                return
            worker = worker_jvm(os.getpid())
            with open(marker + ".tmp", "w") as f:
                json.dump({"time": time.time(), "global_step": global_step, "worker": worker}, f)
            os.rename(marker + ".tmp", marker)
            if os.getpgid(worker) != worker:  # never the group of whoever started the worker
                raise RuntimeError("the worker must lead its own process group (start_new_session)")
            os.killpg(worker, 9)
            os.kill(os.getpid(), 9)


class Pace(Hook):
    """Steps of 0.3 s, as a bigger model's would take, so the fit outlasts three kills and restarts."""

    def after_train_iter(self):
        time.sleep(0.3)


def estimator(**params) -> TorchEstimator:
    return TorchEstimator(**{**dict(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), batchSize=32,
                                    maxEpochs=8, numWorkers=2, seed=3, showProgress=False,
                                    slotWaitTimeout=120.0), **params})


spark = (SparkSession.builder.config("spark.ui.enabled", "false").master(master)
         .config("spark.executor.cores", "1").config("spark.cores.max", "2").config("spark.executor.memory", "1g")
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
rng = np.random.default_rng(1)
x = rng.normal(size=(ROWS, 8))
w = rng.normal(size=8)
ids = np.arange(ROWS) / 1000.0  # the label is the row id (over 1000): every step tells its rows
rows = spark.sparkContext.parallelize([(r.tolist(), float(t)) for r, t in zip(x, ids)], 3)
df = spark.createDataFrame(rows, "features array<double>, label double").cache()
df.count()


def summary(est: TorchEstimator) -> dict:
    return {"history": est.history, "global_step": est.progress.global_step, "samples": est.progress.samples,
            "epoch": est.progress.epoch, "steps": est.checkpoint.hook_states["StepRows"]["steps"]}


result = {}
undisturbed = estimator(hooks=[StepRows(1000.0)])
model = undisturbed.fit(df)
result["undisturbed"] = summary(undisturbed)
# maxRetries=0: a lost worker is never a retry, whether the driver's slot watch cancels the
# job or the kill fails it first
elastic = estimator(minWorkers=1, maxRetries=0, slotWaitTimeout=10.0, checkpointDir=os.path.join(out_dir, "ckpt"),
                    checkpointInterval="10ba", hooks=[StepRows(1000.0), KillWorkers(out_dir), Pace()])
model = elastic.fit(df)
result["elastic"] = summary(elastic)
scored = model.transform(df)
result["scored"] = scored.count()
result["scored_null"] = scored.filter(scored["prediction"].isNull()).count()
result["kills"] = [json.load(open(os.path.join(out_dir, f"killed-{i}.json"))) for i in range(len(KILLS_AT))
                   if os.path.exists(os.path.join(out_dir, f"killed-{i}.json"))]
print("RESULT " + json.dumps(result))
spark.stop()
