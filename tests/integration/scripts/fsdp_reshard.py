"""Run by test_fsdp.py: on local[3], a strategy="fsdp" run saved by 2 ranks resumes on 3.
A hook on the 3 ranks gathers the full weights they loaded before training on, to compare
with the weights the 2-rank fit ended with. ``OUT`` is a folder for checkpoints and files."""

import json
import os
import sys

import numpy as np
import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from spark_torch_est import Hook  # noqa: E402
from tests.helpers import estimator  # noqa: E402

out_dir = sys.argv[1]


class SaveLoadedWeights(Hook):
    """Before the first epoch of a fit, every rank gathers the full weights (collective);
    rank 0 saves them to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def before_run(self, model, rank):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({k: v.detach().cpu() for k, v in state.items()}, self.path)


spark = (SparkSession.builder.master("local[3]").config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "3").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
rng = np.random.default_rng(7)
x = rng.normal(size=(1500, 8)).astype(np.float32)
y = x @ rng.normal(size=8).astype(np.float32) + 0.5
df = spark.createDataFrame([(row.tolist(), float(t)) for row, t in zip(x, y)], ["features", "label"])

loaded = os.path.join(out_dir, "loaded.pt")
est = estimator(seed=5, strategy="fsdp", checkpointDir=os.path.join(out_dir, "ckpt"), timeout=180.0,
                config={"dropout": 0.0, "lr": 0.01, "width": 64}, hooks={"loaded": SaveLoadedWeights(loaded)})
est.fit(df, duration="2ep")
saved = {k: v.clone() for k, v in est.checkpoint.model_state.items()}
est.setNumWorkers(3)
est.fit(df, duration="1ep")
restored = torch.load(loaded)
result = {
    "history": est.history,
    "files": sorted(os.listdir(est.checkpoint.sharded["url"])),
    "same_weights": sorted(k for k in saved if torch.equal(saved[k], restored[k])),
    "keys": sorted(saved),
}
print("RESULT " + json.dumps(result))
spark.stop()
