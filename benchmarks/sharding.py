"""Memory of a large model, strategy="ddp" against "fsdp": each rank's peak RSS, the
checkpoint's time, and the driver's peak RSS during the fit.

Runnable alone: ``python -m benchmarks.sharding [--layers 4] [--width 4096]``. Each
strategy runs in its own driver process (so the driver's peak is its own) with
``spark.python.worker.reuse=false`` (so each rank's peak is its fit's). The model is
``layers`` x ``Linear(width, width)`` with Adam: ``layers * width**2 * 4`` bytes of weights
(4 x 4096: 268 MB), two more copies for Adam's moments, one for the gradients.

A rank's checkpoint time is the time from its last ``after_train_epoch`` to ``after_run``:
the one checkpoint of the one-epoch fit (``checkpointInterval="1ep"``), with "ddp" rank 0
serializing the whole state and writing it, with "fsdp" every rank writing its part.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from benchmarks.common import RESULT, peak_rss_mb, register_by_value, run_child, spark_session

__all__ = ["main"]


def _model(config: dict):
    from torch import nn

    width = config["width"]
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(config["layers"])])


def _adam(model, config: dict):
    import torch

    return torch.optim.Adam(model.parameters(), lr=1e-4)


def _hook(folder: str):
    from spark_torch_est import Hook

    class Measure(Hook):
        """Writes each rank's peak RSS and checkpoint time to ``folder``."""

        def __init__(self) -> None:
            self.ended = 0.0

        def after_train_epoch(self) -> None:
            self.ended = time.perf_counter()

        def after_run(self, rank) -> None:
            with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
                json.dump({"peak_rss_mb": peak_rss_mb(), "checkpoint_s": time.perf_counter() - self.ended}, handle)

    return Measure()


def run_one(strategy: str, layers: int, width: int) -> dict:
    """One fit in this process; returns the figures."""
    import numpy as np
    import torch

    from spark_torch_est import TorchEstimator

    register_by_value()
    out, ckpt = tempfile.mkdtemp(), tempfile.mkdtemp()
    conf = {"spark.python.worker.reuse": "false", "spark.driver.memory": "4g"}
    try:
        with spark_session(2, "bench-sharding", **conf) as spark:
            rows = np.random.default_rng(0).normal(size=(64, width)).astype(np.float32)
            df = spark.createDataFrame([(r.tolist(), r.tolist()) for r in rows], ["features", "label"])
            est = TorchEstimator(model=_model, optimizer=_adam, loss=torch.nn.MSELoss(),
                                 config={"layers": layers, "width": width}, hooks=[_hook(out)], batchSize=16,
                                 maxEpochs=1, numWorkers=2, strategy=strategy, checkpointDir=ckpt, showProgress=False)
            started = time.perf_counter()
            est.fit(df)
            fit_s = time.perf_counter() - started
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
        written = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(ckpt) for name in names)
        return {"strategy": strategy, "fit_s": fit_s,
                "weights_mb": layers * (width * width + width) * 4 / 2 ** 20,
                "rank_peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
                "checkpoint_s": [r["checkpoint_s"] for r in ranks],
                "checkpoint_dir_mb": written / 2 ** 20, "driver_peak_rss_mb": peak_rss_mb()}
    finally:
        for folder in (out, ckpt):
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), help="run one strategy in this process")
    args = parser.parse_args(argv)
    if args.strategy:
        print(RESULT + json.dumps(run_one(args.strategy, args.layers, args.width)))
        return
    print("| strategy | weights MB | rank peak RSS MB (0, 1) | checkpoint s (0, 1) | checkpointDir MB | "
          "driver peak RSS MB | fit s |")
    print("|---|---|---|---|---|---|---|")
    for strategy in ("ddp", "fsdp"):
        r = run_child("sharding", "--strategy", strategy, "--layers", str(args.layers), "--width", str(args.width))
        print(f"| {strategy} | {r['weights_mb']:.0f} | {r['rank_peak_rss_mb'][0]:.0f}, {r['rank_peak_rss_mb'][1]:.0f} "
              f"| {r['checkpoint_s'][0]:.2f}, {r['checkpoint_s'][1]:.2f} | {r['checkpoint_dir_mb']:.0f} | "
              f"{r['driver_peak_rss_mb']:.0f} | {r['fit_s']:.1f} |")


if __name__ == "__main__":
    main()
