"""``python -m benchmarks.precision [--rows N] [--epochs N] [--rounds N]``: the loop under
``precision`` "32" and "bf16-mixed", with and without ``compileModel``, against the plain
torch loop doing the same, on the CPU.

The reference workload's rank (rows x 32 float32 features, MLP 32-256-256-1, MSE, SGD lr
0.01, batch 256, 1 thread) in this process, no Spark: ``TorchEstimator``'s loop through
``spark_torch_est.worker.run_rank`` on a ``LocalBarrier`` (as ``benchmarks.hook_overhead``),
and :func:`benchmarks.loop.train` with the same autocast and the same ``torch.compile``
(``dynamic=False``). Every run starts from a fresh model (and, compiled, from a reset
compiler with inductor's on-disk cache off: every compile is a real one, as a fit's on a
new machine). Rounds are interleaved, the contenders' order alternating; the table gives
medians:

- first step: seconds from the call to the end of the first optimizer step (building the
  model, and compiling it where it is compiled);
- samples/s: the last epoch after its first step, wall clock (by then the last, smaller
  batch of an epoch has been compiled too);
- CPU us/sample: the same stretch in process CPU time (1 thread; other load barely moves it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict

import cloudpickle
import numpy as np
import pyarrow as pa
import torch
import torch._inductor.config

from benchmarks.hook_overhead import _SCHEMA
from benchmarks.loop import train
from benchmarks.probes import StepClock
from benchmarks.workload import Workload, make_model, make_optimizer
from spark_torch_est import Checkpoint, Hook
from spark_torch_est.barrier import LocalBarrier
from spark_torch_est.creators import Creators
from spark_torch_est.hooks import normalize_hooks
from spark_torch_est.precision import PRECISIONS
from spark_torch_est.progress import Target
from spark_torch_est.protocol import FEATURES, LABEL
from spark_torch_est.spec import Launch, TaskSpec
from spark_torch_est.worker import run_rank

__all__ = ["main"]

_LAUNCH = Launch(job_id="bench-precision", secret=b"p" * 32)
#: (precision, compiled) in the order of the table.
CONFIGS = (("32", False), ("bf16-mixed", False), ("32", True), ("bf16-mixed", True))


class Clock(Hook):
    """Stamps the first optimizer step of the fit and every step of the last epoch (after
    its hooks: the last stage of a step)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.clock = StepClock()
        self.samples = 0

    def before_train_epoch(self):
        self.clock = StepClock()

    def after_train_iter(self, labels):
        self.samples += len(labels)
        self.clock.step(self.samples)
        self.first = self.first or self.clock.first

    def state_dict(self):
        return {"first": self.first, "last_epoch": asdict(self.clock)}


def _figures(started: float, first: float, last_epoch: StepClock) -> dict[str, float]:
    samples = last_epoch.samples_last - last_epoch.samples_first
    return {"first_step_s": first - started, "samples_per_s": samples / (last_epoch.last - last_epoch.first),
            "cpu_us_per_sample": (last_epoch.cpu_last - last_epoch.cpu_first) * 1e6 / samples}


def _ours(batch: pa.RecordBatch, workload: Workload, precision: str, compiled: bool) -> dict[str, float]:
    creators = Creators(model=make_model, optimizer=make_optimizer, loss=workload.loss_fn(),
                        hooks=normalize_hooks({"clock": Clock()}), config=workload.config)
    spec = TaskSpec(run_id="0123456789ab", fit_id="bench", payload=cloudpickle.dumps(creators), resume=None,
                    target=Target(epoch=workload.epochs), schema=_SCHEMA, world_size=1,
                    batch_size=workload.batch_size, seed=workload.seed, timeout_s=60, precision=precision,
                    compile_model=compiled)
    started = time.time()
    checkpoint = Checkpoint.from_bytes(run_rank(spec, _LAUNCH, iter([batch]), LocalBarrier()))
    stamps = checkpoint.hook_states["clock"]
    return _figures(started, stamps["first"], StepClock(**stamps["last_epoch"]))


def _plain(x: torch.Tensor, y: torch.Tensor, workload: Workload, precision: str, compiled: bool) -> dict[str, float]:
    started = time.time()
    model, optimizer = workload.build()
    if compiled:
        import torch._dynamo

        torch._dynamo.reset()
        model = torch.compile(model, dynamic=False)
    clocks = [train(model, optimizer, (x,), y, workload.loss_fn(), epochs=1, batch_size=workload.batch_size,
                    seed=workload.seed, autocast=PRECISIONS[precision]) for _ in range(workload.epochs)]
    return _figures(started, clocks[0].first, clocks[-1])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.precision")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=2, help="at least 2: the last one is timed")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch._inductor.config.fx_graph_cache = False
    workload = Workload(rows=args.rows, epochs=args.epochs, ranks=1)
    rng = np.random.default_rng(workload.seed)
    x = rng.normal(size=(args.rows, workload.features)).astype(np.float32)
    y = (x @ rng.normal(size=workload.features).astype(np.float32)).astype(np.float32)
    batch = pa.RecordBatch.from_arrays([pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), workload.features),
                                        pa.array(y)], [FEATURES, LABEL])
    tensors = torch.from_numpy(x), torch.from_numpy(y).reshape(-1, 1)
    results: dict[tuple[str, bool, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for precision, compiled in CONFIGS:
            for who in (("ours", "plain") if round_ % 2 == 0 else ("plain", "ours")):
                figures = (_ours(batch, workload, precision, compiled) if who == "ours"
                           else _plain(*tensors, workload, precision, compiled))
                results.setdefault((precision, compiled, who), []).append(figures)
    print(f"one rank on the CPU, {args.rows:,} rows x {workload.features} float32, MLP 32-256-256-1, SGD, batch "
          f"{workload.batch_size}, {args.epochs} epoch(s), 1 thread, median of {args.rounds} interleaved rounds")
    print(f"{'precision':<11} {'compiled':<9} {'contender':<15} {'first step s':>12} {'samples/s':>11} "
          f"{'CPU us/sample':>14} {'vs plain':>9}")
    for precision, compiled in CONFIGS:
        medians = {who: {key: statistics.median(r[key] for r in results[(precision, compiled, who)])
                         for key in ("first_step_s", "samples_per_s", "cpu_us_per_sample")}
                   for who in ("plain", "ours")}
        for who, name in (("plain", "plain torch"), ("ours", "TorchEstimator")):
            m = medians[who]
            ratio = m["cpu_us_per_sample"] / medians["plain"]["cpu_us_per_sample"]
            print(f"{precision:<11} {str(compiled):<9} {name:<15} {m['first_step_s']:12.2f} "
                  f"{m['samples_per_s']:11,.0f} {m['cpu_us_per_sample']:14.2f} {ratio:8.2f}x")


if __name__ == "__main__":
    main()
