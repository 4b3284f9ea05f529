"""GPU smoke check for a machine with CUDA GPUs: a short DDP fit over nccl, one GPU per rank.

    PYSPARK_PYTHON=$(which python) SPARK_LOCAL_IP=127.0.0.1 python scripts/gpu_smoke.py

Exits 0 and prints "GPU SMOKE OK" when every rank trained on its own GPU with nccl and the
model learned; exits 2 at once on a machine without CUDA.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    print("no CUDA device visible to torch: nothing to check here")
    sys.exit(2)

from pyspark.sql import SparkSession  # noqa: E402

from spark_torch_est import Hook, TorchEstimator  # noqa: E402

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
GPUS = torch.cuda.device_count()
WORKERS = min(2, GPUS)
OUT = tempfile.mkdtemp()


class Where(Hook):
    def before_run(self, rank, device, model):
        import torch.distributed as dist

        info = {"device": str(device), "param_device": str(next(model.parameters()).device),
                "backend": dist.get_backend() if dist.is_initialized() else None}
        with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
            json.dump(info, f)


def model(config):
    return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))


def mixed_precision_step_ok() -> bool:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model({}).cuda()(torch.randn(8, 32, device="cuda"))
    return out.dtype == torch.bfloat16


spark = SparkSession.builder.master(f"local[{WORKERS}]").getOrCreate()
rng = np.random.default_rng(0)
x = rng.normal(size=(100_000, 32)).astype(np.float32)
w = rng.normal(size=32).astype(np.float32)
df = spark.createDataFrame([(r.tolist(), float(r @ w)) for r in x[:20_000]], ["features", "label"])
est = TorchEstimator(model=model, optimizer=lambda m, c: torch.optim.Adam(m.parameters(), lr=1e-3),
                     loss=torch.nn.MSELoss(), batchSize=256, maxEpochs=3, numWorkers=WORKERS, useGpu=True,
                     hooks=[Where()], showProgress=False)
started = time.time()
fitted = est.fit(df)
elapsed = time.time() - started
ranks = [json.load(open(os.path.join(OUT, f"rank{r}.json"))) for r in range(WORKERS)]
scored = fitted.transform(df).select("label", "prediction").toPandas()
rmse = float(np.sqrt(((scored.label - scored.prediction) ** 2).mean()))
print(json.dumps({"gpus": GPUS, "workers": WORKERS, "ranks": ranks, "fit_s": round(elapsed, 1),
                  "history": est.history, "rmse": rmse, "bf16_autocast": mixed_precision_step_ok()}, indent=1))
ok = (len({r["device"] for r in ranks}) == WORKERS and all(r["device"].startswith("cuda") for r in ranks)
      and all(r["param_device"] == r["device"] for r in ranks)
      and (WORKERS == 1 or all(r["backend"] == "nccl" for r in ranks))
      and est.history[-1]["train_loss"] < est.history[0]["train_loss"])
print("GPU SMOKE OK" if ok else "GPU SMOKE FAILED")
spark.stop()
sys.exit(0 if ok else 1)
