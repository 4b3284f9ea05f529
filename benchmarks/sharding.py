"""``python -m benchmarks.sharding [--layers 4] [--width 4096]``: memory of a large model
(``layers`` x ``Linear(width, width)``, Adam), strategy="ddp" against "fsdp": each rank's peak
RSS, its checkpoint's time (from its last ``after_train_epoch`` to ``after_run``) and the
driver's peak RSS. Each strategy runs in its own driver process, Python workers not reused.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch
from torch import nn

from benchmarks.common import RESULT, Probe, markdown, peak_rss_mb, register_by_value, run_child, spark_session
from spark_torch_est import TorchEstimator

__all__ = ["main"]


def _model(config: dict) -> nn.Module:
    return nn.Sequential(*[nn.Linear(config["width"], config["width"]) for _ in range(config["layers"])])


def _adam(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-4)


def run_one(strategy: str, layers: int, width: int) -> dict:
    """One fit in this process; returns the figures."""
    register_by_value()
    conf = {"spark.python.worker.reuse": "false", "spark.driver.memory": "4g"}
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as ckpt:
        probe = Probe(out, strategy)
        with spark_session(2, "bench-sharding", **conf) as spark:
            rows = np.random.default_rng(0).normal(size=(64, width)).astype(np.float32)
            df = spark.createDataFrame([(r.tolist(), r.tolist()) for r in rows], ["features", "label"])
            est = TorchEstimator(model=_model, optimizer=_adam, loss=nn.MSELoss(),
                                 config={"layers": layers, "width": width}, hooks=[probe], batchSize=16,
                                 maxEpochs=1, numWorkers=2, strategy=strategy, checkpointDir=ckpt, showProgress=False)
            started = time.perf_counter()
            est.fit(df)
            fit_s = time.perf_counter() - started
        ranks = probe.reports(2)
        written = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(ckpt) for name in names)
    return {"strategy": strategy, "fit_s": fit_s, "weights_mb": layers * (width * width + width) * 4 / 2 ** 20,
            "rank_peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
            "checkpoint_s": [r["after_last_epoch_s"] for r in ranks],
            "checkpoint_dir_mb": written / 2 ** 20, "driver_peak_rss_mb": peak_rss_mb()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharding", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), help="run one strategy in this process")
    args = parser.parse_args(argv)
    if args.strategy:
        print(RESULT + json.dumps(run_one(args.strategy, args.layers, args.width)))
        return
    rows = []
    for strategy in ("ddp", "fsdp"):
        r = run_child("sharding", "--strategy", strategy, "--layers", str(args.layers), "--width", str(args.width))
        rows.append([strategy, f"{r['weights_mb']:.0f}", ", ".join(f"{mb:.0f}" for mb in r["rank_peak_rss_mb"]),
                     ", ".join(f"{s:.2f}" for s in r["checkpoint_s"]), f"{r['checkpoint_dir_mb']:.0f}",
                     f"{r['driver_peak_rss_mb']:.0f}", f"{r['fit_s']:.1f}"])
    print(markdown(["strategy", "weights MB", "rank peak RSS MB (0, 1)", "checkpoint s (0, 1)", "checkpointDir MB",
                    "driver peak RSS MB", "fit s"], rows))


if __name__ == "__main__":
    main()
