"""GPU smoke check for a machine with CUDA GPUs: what the loop needs on a GPU, measured.

    PYSPARK_PYTHON=$(which python) SPARK_LOCAL_IP=127.0.0.1 python scripts/gpu_smoke.py

1. Copies overlapping steps: ``spark_torch_est.train.prefetch`` against copying each batch
   before its step (pinned memory, ``non_blocking``, a side stream), no Spark.
2. Fits on ``local-cluster[W,1,4096]`` (W = min(2, GPUs)), whose workers each offer one
   GPU through a discovery script and whose tasks each take one
   (``spark.task.resource.gpu.amount=1``): nccl DDP under precision "32", "bf16-mixed"
   and "16-mixed", and "bf16-mixed" with ``compileModel=True``; each rank records its
   device, backend, Spark's address, the dtypes a hook sees and where its batches are.
3. ``transform`` of the fitted model: each scoring task records the device it ran on.

Prints one JSON document of figures, then "GPU SMOKE OK" (exit 0) or "GPU SMOKE FAILED"
(exit 1); exits 2 at once on a machine without CUDA.
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
from spark_torch_est.train.builtin_hooks import Throughput  # noqa: E402
from spark_torch_est.train.prefetch import CudaTransfer, prefetch  # noqa: E402

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
GPUS = torch.cuda.device_count()
WORKERS = min(2, GPUS)
OUT = tempfile.mkdtemp(prefix="gpu_smoke_")


# ------------------------------------------------------------------ 1. overlapped copies

def overlap_figures(steps: int = 20, rows: int = 1 << 21, width: int = 32) -> dict:
    """ms per step with each batch copied before its step, and with the next batch's copy
    on a side stream during the step; and whether both saw the same data."""
    device = torch.device("cuda", 0)
    batches = [(torch.randn(rows, width), torch.randn(rows)) for _ in range(steps)]
    weight = torch.randn(width, width, device=device)

    def step(x: torch.Tensor) -> torch.Tensor:
        for _ in range(30):
            x = torch.tanh(x @ weight)
        return x.sum()

    def run(moved) -> tuple[float, list[float]]:
        torch.cuda.synchronize()
        started = time.perf_counter()
        sums = [step(x) + y.sum() for x, y in moved]
        torch.cuda.synchronize()
        return (time.perf_counter() - started) / steps * 1e3, [float(s) for s in sums]

    run(((x.to(device), y.to(device)) for x, y in batches[:2]))  # warm-up
    sequential, sums_a = run(((x.to(device), y.to(device)) for x, y in batches))
    overlapped, sums_b = run(prefetch(batches, CudaTransfer(device)))
    return {"sequential_ms_per_step": round(sequential, 2), "prefetched_ms_per_step": round(overlapped, 2),
            "same_results": bool(np.allclose(sums_a, sums_b)), "batch_mb": round(rows * (width + 1) * 4 / 2**20)}


# ------------------------------------------------------------------------- 2. the fits

class Where(Hook):
    """Writes what one rank sees: device, backend, Spark's GPU address, dtypes, batch device."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: dict = {}

    def before_run(self, rank, device, model):
        import torch.distributed as dist
        from pyspark import BarrierTaskContext

        gpus = BarrierTaskContext.get().resources().get("gpu")
        self.seen = {"rank": rank, "device": str(device), "param_device": str(next(model.parameters()).device),
                     "backend": dist.get_backend() if dist.is_initialized() else None,
                     "spark_gpus": list(gpus.addresses) if gpus else [],
                     "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def after_train_iter(self, inputs, outputs, model, scaler):
        self.seen.setdefault("batch_device", str(inputs.device))
        self.seen.setdefault("outputs_dtype", str(outputs.dtype))
        self.seen.setdefault("weights_dtype", str(next(model.parameters()).dtype))
        self.seen["scale"] = scaler.get_scale() if scaler.is_enabled() else None

    def after_run(self, rank):
        with open(os.path.join(OUT, f"{self.name}-rank{rank}.json"), "w") as f:
            json.dump(self.seen, f)


class Recorded(torch.nn.Module):
    """The MLP; under inference mode (transform) it records the device, output dtype and
    Spark's GPU address of each scoring task."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                       torch.nn.ReLU(), torch.nn.Linear(1024, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if torch.is_inference_mode_enabled():
            from pyspark import TaskContext

            gpus = TaskContext.get().resources().get("gpu")
            with open(os.path.join(OUT, f"transform-{os.getpid()}.json"), "w") as f:
                json.dump({"device": str(x.device), "dtype": str(out.dtype),
                           "spark_gpus": list(gpus.addresses) if gpus else []}, f)
        return out


def discovery_script() -> str:
    """One GPU per worker: the first worker to run it takes GPU 0, the next GPU 1, ..."""
    path = os.path.join(OUT, "gpus.sh")
    with open(path, "w") as f:
        f.write(f"""#!/usr/bin/env bash
for i in $(seq 0 {GPUS - 1}); do
  if mkdir "{OUT}/gpu$i" 2>/dev/null; then echo '{{"name": "gpu", "addresses": ["'$i'"]}}'; exit 0; fi
done
echo '{{"name": "gpu", "addresses": []}}'
""")
    os.chmod(path, 0o755)
    return path


def fit(df, name: str, **params) -> dict:
    est = TorchEstimator(model=lambda config: Recorded(), optimizer=lambda m, c: torch.optim.Adam(m.parameters(), 1e-3),
                         loss=torch.nn.MSELoss(), batchSize=1024, maxEpochs=3, numWorkers=WORKERS, useGpu=True,
                         hooks={"where": Where(name), "throughput": Throughput()}, showProgress=False,
                         slotWaitTimeout=120, **params)
    started = time.perf_counter()
    model = est.fit(df)
    elapsed = time.perf_counter() - started
    ranks = [json.load(open(os.path.join(OUT, f"{name}-rank{r}.json"))) for r in range(WORKERS)]
    return {"model": model, "fit_s": round(elapsed, 1), "ranks": ranks,
            "samples_per_s": [round(e.get("samples_per_s", 0)) for e in est.history],
            "train_loss": [round(e["train_loss"], 4) for e in est.history]}


def main() -> int:
    os.environ.setdefault("SPARK_WORKER_DIR", os.path.join(OUT, "work"))
    figures: dict = {"gpus": GPUS, "workers": WORKERS, "torch": torch.__version__,
                     "overlap": overlap_figures()}
    spark = (SparkSession.builder.master(f"local-cluster[{WORKERS},1,4096]").config("spark.ui.enabled", "false")
             .config("spark.worker.resource.gpu.amount", "1")
             .config("spark.worker.resource.gpu.discoveryScript", discovery_script())
             .config("spark.executor.resource.gpu.amount", "1")
             .config("spark.task.resource.gpu.amount", "1")
             .getOrCreate())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200_000, 32)).astype(np.float32)
    w = rng.normal(size=32).astype(np.float32)
    df = spark.createDataFrame([(r.tolist(), float(r @ w)) for r in x], ["features", "label"]).repartition(WORKERS)
    df = df.cache()
    df.count()
    runs = {"32": fit(df, "fp32"), "bf16-mixed": fit(df, "bf16", precision="bf16-mixed"),
            "16-mixed": fit(df, "fp16", precision="16-mixed"),
            "bf16-mixed+compile": fit(df, "bf16c", precision="bf16-mixed", compileModel=True)}
    started = time.perf_counter()
    scored = runs["bf16-mixed"]["model"].transform(df).select("label", "prediction").toPandas()
    transform_s = time.perf_counter() - started
    scoring = [json.load(open(os.path.join(OUT, f))) for f in os.listdir(OUT) if f.startswith("transform-")]
    figures["fits"] = {name: {k: v for k, v in run.items() if k != "model"} for name, run in runs.items()}
    figures["transform"] = {"rows": len(scored), "s": round(transform_s, 1), "tasks": scoring,
                            "rmse": float(np.sqrt(((scored.label - scored.prediction) ** 2).mean()))}
    print(json.dumps(figures, indent=1))
    spark.stop()

    expected_dtype = {"32": "torch.float32", "bf16-mixed": "torch.bfloat16", "16-mixed": "torch.float16",
                      "bf16-mixed+compile": "torch.bfloat16"}
    checks = {"overlap": figures["overlap"]["same_results"]
              and figures["overlap"]["prefetched_ms_per_step"] < figures["overlap"]["sequential_ms_per_step"]}
    for name, run in runs.items():
        ranks = run["ranks"]
        checks[name] = (len({r["device"] for r in ranks}) == WORKERS
                        and all(r["device"] == f"cuda:{int(r['spark_gpus'][0])}" for r in ranks)
                        and all(r["param_device"] == r["device"] == r["batch_device"] for r in ranks)
                        and all(r["backend"] == "nccl" for r in ranks)
                        and all(r["outputs_dtype"] == expected_dtype[name] for r in ranks)
                        and all(r["weights_dtype"] == "torch.float32" for r in ranks)
                        and run["train_loss"][-1] < run["train_loss"][0])
    checks["transform"] = bool(scoring) and all(t["device"] == f"cuda:{int(t['spark_gpus'][0])}"
                                                and t["dtype"] == "torch.bfloat16" for t in scoring)
    print(json.dumps({"checks": checks}))
    ok = all(checks.values())
    print("GPU SMOKE OK" if ok else "GPU SMOKE FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
