"""Run by test_cluster.py: fits on local-cluster[2,1,1024] (two executor JVMs) whose workers
offer fake GPUs through a discovery script, as Spark's own tests do; the executors mask
GPUs with CUDA_VISIBLE_DEVICES."""

import json
import logging
import os
import sys

import numpy as np
import torch
from pyspark import BarrierTaskContext
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import Hook, TorchEstimator  # noqa: E402
from spark_torch_est.errors import InvalidInputError  # noqa: E402
from spark_torch_est.train.devices import task_gpu, task_gpus  # noqa: E402
from tests.helpers import linear_model, sgd, spark_jobs_started  # noqa: E402

out_dir, discovery = sys.argv[1], sys.argv[2]
VISIBLE = "3,5"  # the executors see two GPUs, whose Spark addresses are 0 and 1


class WhereAmI(Hook):
    """Records the task's GPU addresses, device and executor JVM per rank."""

    def before_run(self, rank, device):
        gpus = BarrierTaskContext.get().resources().get("gpu")
        addresses = list(gpus.addresses) if gpus else []
        with open(f"/proc/{os.getppid()}/stat") as f:  # the worker's parent is pyspark's daemon,
            jvm = int(f.read().rsplit(")", 1)[1].split()[1])  # whose parent is the executor JVM
        gpu = task_gpu(addresses, os.environ.get("CUDA_VISIBLE_DEVICES"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"gpus": addresses, "device": str(device), "jvm": jvm, "index": gpu.index,
                       "physical": gpu.physical}, f)


def transform_tasks_gpus(batches):
    """What a scoring task of transform sees: its GPU addresses, and where they map."""
    import pandas as pd

    addresses, partition = task_gpus()
    gpu = task_gpu(addresses, os.environ.get("CUDA_VISIBLE_DEVICES"))
    for _ in batches:
        pass
    yield pd.DataFrame({"partition": [partition], "gpus": [",".join(addresses)], "index": [gpu.index],
                        "physical": [gpu.physical]})


class Collect(logging.Handler):
    """Keeps the driver's log lines (the ranks' warnings arrive there)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


spark = (SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.ui.enabled", "false")
         .config("spark.worker.resource.gpu.amount", "2")
         .config("spark.worker.resource.gpu.discoveryScript", discovery)
         .config("spark.executor.resource.gpu.amount", "1")
         .config("spark.task.resource.gpu.amount", "1")
         .config("spark.executorEnv.CUDA_VISIBLE_DEVICES", VISIBLE)
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
rng = np.random.default_rng(1)
x = rng.normal(size=(2000, 8))
w = rng.normal(size=8)
rows = spark.sparkContext.parallelize([(r.tolist(), float(r @ w + 0.5)) for r in x], 3)  # 3 partitions: ours shuffle
df = spark.createDataFrame(rows, "features array<double>, label double")
est = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), batchSize=32, maxEpochs=4,
                     numWorkers=2, showProgress=False, hooks=[WhereAmI()], slotWaitTimeout=120)
collected = Collect()
logging.getLogger("spark_torch_est").addHandler(collected)
logging.getLogger("spark_torch_est").setLevel(logging.INFO)
model = est.fit(df, duration="2ep")
model = est.fit(df)  # a second fit across the same executors resumes the run
learned = model.torch_model()
error = float(np.abs(learned.weight.detach().numpy().ravel() - w).max())
predictions = model.transform(df).select("label", "prediction").toPandas()
rmse = float(np.sqrt(((predictions.label - predictions.prediction) ** 2).mean()))
try:
    TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), useGpu=True, maxEpochs=1,
                   showProgress=False).fit(df)
    gpu_error = None
except InvalidInputError as exc:
    gpu_error = str(exc)
ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in (0, 1)]
scoring = df.mapInPandas(transform_tasks_gpus, "partition long, gpus string, index long, physical string") \
    .toPandas().to_dict("records")
on_cpu = [line for line in collected.lines if "but torch sees no CUDA device" in line]


class KillExecutorOnce(Hook):
    """Kills rank 1's executor JVM (SIGKILL) in the middle of epoch 3, the first time only."""

    def after_train_iter(self, rank, state):
        marker = os.path.join(out_dir, "killed")
        if rank == 1 and state.epoch == 2 and state.batch_in_epoch == 5 and not os.path.exists(marker):
            open(marker, "w").close()
            with open(f"/proc/{os.getppid()}/stat") as f:
                os.kill(int(f.read().rsplit(")", 1)[1].split()[1]), 9)


class CrashTwice(Hook):
    """Hard-exits rank 1's Python worker at batch 5 of epoch 3, in two launches in a row."""

    def after_train_iter(self, rank, state):
        crashes = [name for name in os.listdir(out_dir) if name.startswith("crash-")]
        if rank == 1 and state.epoch == 2 and state.batch_in_epoch == 5 and len(crashes) < 2:
            open(os.path.join(out_dir, f"crash-{len(crashes)}"), "w").close()
            os._exit(3)


def run(hooks, **params):
    fitted = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), batchSize=32, maxEpochs=4,
                            numWorkers=2, showProgress=False, hooks=hooks, slotWaitTimeout=120, seed=3, **params)
    fitted.fit(df)
    return fitted


clean = run([])
faulty = run([KillExecutorOnce()], checkpointDir=os.path.join(out_dir, "ckpt"), maxRetries=1, minWorkers=1)
same = all(torch.equal(v, faulty.checkpoint.model_state[k]) for k, v in clean.checkpoint.model_state.items())
twice = run([CrashTwice()], checkpointDir=os.path.join(out_dir, "ckpt-twice"), maxRetries=2, minWorkers=1)
twice_same = all(torch.equal(v, twice.checkpoint.model_state[k]) for k, v in clean.checkpoint.model_state.items())
# Fit many, ingest once across executor JVMs: each executor keeps only its own rank's part,
# and a later fit's tasks take the ranks of the parts their executors hold, wherever Spark
# put them; 1+1+2 epochs on kept rows equal 4 epochs read again.
df.write.parquet(os.path.join(out_dir, "table"))
table = spark.read.parquet(os.path.join(out_dir, "table")).filter("label > -1e9").cache()
before = len(collected.lines)
kept = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), batchSize=32, maxEpochs=4,
                      numWorkers=2, showProgress=False, slotWaitTimeout=120, seed=3)
reread = kept.copy({kept.keepIngestedMB: 0.0})
for duration in ("1ep", "1ep", None):
    kept.fit(table, duration=duration)
reread.fit(table)
kept_lines = collected.lines[before:]
kept_result = {"kept_reused": sum("kept this DataFrame's rows" in line for line in kept_lines),
               "kept_missing": sum("rows of this DataFrame are gone" in line for line in kept_lines),
               "kept_equal": all(torch.equal(v, reread.checkpoint.model_state[k])
                                 for k, v in kept.checkpoint.model_state.items())}
# More ranks than the two executors' slots, or a minWorkers above them: refused with both
# numbers once slotWaitTimeout has passed, before any Spark job.
started, refused = spark_jobs_started(spark), {}
for name, params in (("numWorkers", {"numWorkers": 3}), ("minWorkers", {"numWorkers": 4, "minWorkers": 3})):
    try:
        TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), maxEpochs=1, showProgress=False,
                       slotWaitTimeout=3.0, **params).fit(df)
    except InvalidInputError as exc:
        refused[name] = str(exc)
kept_result.update(refused=refused, refused_jobs=spark_jobs_started(spark) - started)
print("RESULT " + json.dumps({**kept_result, "weight_error": error, "rmse": rmse, "epochs": est.progress.epoch,
                              "ranks": ranks, "gpu_error": gpu_error, "scoring": scoring, "on_cpu": on_cpu,
                              "visible": VISIBLE,
                              "killed": os.path.exists(os.path.join(out_dir, "killed")),
                              "recovered_equal": same, "recovered_epochs": [e["epoch"] for e in faulty.history],
                              "recovered_sizes": [e["world_size"] for e in faulty.history],
                              "crashes": len([n for n in os.listdir(out_dir) if n.startswith("crash-")]),
                              "twice_equal": twice_same, "twice_sizes": [e["world_size"] for e in twice.history]}))
spark.stop()
