"""Run by test_cluster.py: elastic fits (minWorkers). ``local OUT``: on local[1] with
numWorkers=2. ``standalone OUT MASTER``: on a standalone master with two one-core workers, a
hook kills one whole worker (SIGKILL) in the middle of a fit; the test restarts it
(``OUT/restarted``) before the next fit; then the same kill without minWorkers, as today."""

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
from spark_torch_est.errors import InvalidInputError  # noqa: E402
from tests.helpers import RecordRows, descendants, linear_model, sgd, spark_jobs_started, worker_jvm  # noqa: E402

mode, out_dir = sys.argv[1], sys.argv[2]
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
logging.getLogger("spark_torch_est.fit").setLevel(logging.INFO)


class KillWorkerOnce(Hook):
    """SIGKILLs rank 1's whole worker (its JVM, its executor JVM, their Python processes) at
    batch 5 of epoch 2, the first time only; records when, in ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def after_train_iter(self, rank, state):
        if rank == 1 and state.epoch == 1 and state.batch_in_epoch == 5 and not os.path.exists(self.marker):
            worker = worker_jvm(os.getpid())
            victims = [worker, *sorted(descendants(worker) - {os.getpid()})]
            with open(self.marker, "w") as f:
                json.dump({"time": time.time(), "killed": victims}, f)
            for pid in victims:
                os.kill(pid, 9)
            os.kill(os.getpid(), 9)


class FirstSteps(Hook):
    """Appends ``time world_size global_step`` to ``path`` at the first step of each job (rank 0)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen = False

    def before_train_iter(self, rank, world_size, global_step):
        if rank == 0 and not self.seen:
            self.seen = True
            with open(self.path, "a") as f:
                f.write(f"{time.time()} {world_size} {global_step}\n")


def estimator(**params) -> TorchEstimator:
    return TorchEstimator(**{**dict(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), batchSize=32,
                                    maxEpochs=4, numWorkers=2, seed=3, showProgress=False), **params})


builder = SparkSession.builder.config("spark.ui.enabled", "false")
if mode == "local":
    builder = builder.master("local[1]")
else:
    builder = (builder.master(sys.argv[3]).config("spark.executor.cores", "1").config("spark.cores.max", "2")
               .config("spark.executor.memory", "1g"))
spark = builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
rng = np.random.default_rng(1)
x = rng.normal(size=(2000, 8))
w = rng.normal(size=8)
labels = x @ w + 0.5
np.save(os.path.join(out_dir, "labels.npy"), labels.astype(np.float32))
rows = spark.sparkContext.parallelize([(r.tolist(), float(t)) for r, t in zip(x, labels)], 3)
df = spark.createDataFrame(rows, "features array<double>, label double").cache()
df.count()
result = {}


def summary(est: TorchEstimator) -> dict:
    weights = est.checkpoint.model_state["weight"].numpy().ravel()
    return {"history": est.history, "global_step": est.progress.global_step,
            "weight_error": float(np.abs(weights - w).max())}


if mode == "local":
    os.makedirs(os.path.join(out_dir, "rows"))
    elastic = estimator(minWorkers=1, maxEpochs=3, hooks=[RecordRows(os.path.join(out_dir, "rows"))])
    elastic.fit(df)
    result["elastic"] = summary(elastic)
    try:
        estimator(maxEpochs=1).fit(df)
    except InvalidInputError as error:
        result["error"] = str(error)
else:
    undisturbed = estimator(slotWaitTimeout=120.0)  # both executors register first
    undisturbed.fit(df)
    result["undisturbed"] = summary(undisturbed)
    os.makedirs(os.path.join(out_dir, "rows"))
    hooks = [KillWorkerOnce(os.path.join(out_dir, "killed.json")), FirstSteps(os.path.join(out_dir, "steps.log")),
             RecordRows(os.path.join(out_dir, "rows"))]
    elastic = estimator(minWorkers=1, maxRetries=2, slotWaitTimeout=10.0, checkpointDir=os.path.join(out_dir, "ckpt"),
                        hooks=hooks)
    elastic.fit(df)
    result["elastic"] = summary(elastic)
    result["kill"] = json.load(open(os.path.join(out_dir, "killed.json")))
    result["steps"] = [line.split() for line in open(os.path.join(out_dir, "steps.log"))]
    open(os.path.join(out_dir, "fit1-done"), "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(out_dir, "restarted")) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling, with a deadline: the test restarts the worker
    elastic.setMaxEpochs(5).setSlotWaitTimeout(180.0)
    elastic.fit(df)  # grows back: the restarted worker's executor registers within slotWaitTimeout
    result["grown"] = summary(elastic)
    today = estimator(maxRetries=2, slotWaitTimeout=10.0, checkpointDir=os.path.join(out_dir, "ckpt-today"),
                      hooks=[KillWorkerOnce(os.path.join(out_dir, "killed-today.json"))])
    try:
        today.fit(df)
    except InvalidInputError as error:
        failed = time.time()
        result["today_error"] = str(error)
        result["today_seconds"] = failed - json.load(open(os.path.join(out_dir, "killed-today.json")))["time"]
    started = spark_jobs_started(spark)  # one worker is left: a new run's first fit is refused before any job
    try:
        estimator(maxEpochs=1, slotWaitTimeout=3.0).fit(df)
    except InvalidInputError as error:
        result["first_fit_error"] = str(error)
    result["first_fit_jobs"] = spark_jobs_started(spark) - started
print("RESULT " + json.dumps(result))
spark.stop()
