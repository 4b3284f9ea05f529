"""``python -m benchmarks.hook_overhead``: what five no-op hooks cost the training loop.

Runs one rank of the real loop (``spark_torch_est.worker.run_rank``, world size 1, no
Spark) on the reference MLP, with no hooks and with five hooks that override every
per-step stage with ``pass``, interleaved, and prints the loop throughput of both and
their ratio (target: the hooks cost under 2%).
"""

from __future__ import annotations

import argparse
import statistics
import time

import cloudpickle
import numpy as np
import pyarrow as pa
import torch

from spark_torch_est import Hook
from spark_torch_est.creators import Creators
from spark_torch_est.data import FEATURES, LABEL
from spark_torch_est.hooks import normalize_hooks
from spark_torch_est.spec import Target, TaskSpec
from spark_torch_est.barrier import LocalBarrier
from spark_torch_est.worker import run_rank


class NoOp(Hook):
    """Overrides every per-step stage and does nothing."""

    def before_train_iter(self, batch):
        pass

    def before_backward(self, loss):
        pass

    def after_backward(self, model):
        pass

    def before_optimizer_step(self, optimizer):
        pass

    def after_optimizer_step(self, global_step):
        pass

    def after_train_iter(self, loss, batch_idx):
        pass


def _model(config):
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 1))


def _run(batches: list[pa.RecordBatch], hooks: int, epochs: int) -> float:
    creators = Creators(model=_model, optimizer=lambda m, c: torch.optim.SGD(m.parameters(), lr=0.01),
                        loss=torch.nn.MSELoss(), hooks=normalize_hooks([NoOp() for _ in range(hooks)]))
    spec = TaskSpec(job_id="bench/", run_id="bench", payload=cloudpickle.dumps(creators), resume=None,
                    target=Target(epochs, epochs), world_size=1, batch_size=256, seed=0, store_host=None,
                    store_port=None, timeout_s=60)
    started = time.process_time()  # CPU time of this single-threaded loop: other load barely moves it
    run_rank(spec, iter(batches), LocalBarrier())
    return time.process_time() - started


def _dispatch_us(stages: tuple[str, ...]) -> float:
    """Microseconds the dispatcher spends per step calling five no-op hooks."""
    from spark_torch_est.hooks import STAGE_ARGUMENTS, HookSet

    hooks = HookSet(normalize_hooks([NoOp() for _ in range(5)]))
    context = {name: name for stage in stages for name in STAGE_ARGUMENTS[stage]}
    calls = 20_000
    started = time.perf_counter()
    for _ in range(calls):
        for stage in stages:
            hooks.call(stage, context)
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hook_overhead")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 32)).astype(np.float32)
    batch = pa.RecordBatch.from_arrays([pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 32),
                                        pa.array(x.sum(axis=1))], [FEATURES, LABEL])
    times: dict[int, list[float]] = {0: [], 5: []}
    _run([batch], 0, 1)  # warm-up: allocator, kernels
    for round_ in range(args.rounds):
        for hooks in ((0, 5) if round_ % 2 == 0 else (5, 0)):  # alternate: the order itself costs
            times[hooks].append(_run([batch], hooks, args.epochs))
    samples = args.rows * args.epochs
    base, hooked = statistics.median(times[0]), statistics.median(times[5])
    step_us = base / (samples / 256) * 1e6
    dispatch = _dispatch_us(("before_train_iter", "before_backward", "after_backward", "before_optimizer_step",
                             "after_optimizer_step", "after_train_iter"))
    print(f"loop of one rank, {args.rows:,} rows x {args.epochs} epochs, batch 256, 1 thread, "
          f"median of {args.rounds} interleaved rounds (ABBA order)")
    print(f"  no hooks:          {samples / base:12,.0f} samples/s  ({base:.2f} s)")
    print(f"  five no-op hooks:  {samples / hooked:12,.0f} samples/s  ({hooked:.2f} s)")
    print(f"  loop CPU time with the hooks: {100 * (hooked / base - 1):+.2f}% (run-to-run noise is several %)")
    print(f"  dispatching five no-op hooks at the 6 per-step stages: {dispatch:.1f} us per step, "
          f"{100 * dispatch / step_us:.2f}% of a {step_us:.0f} us step (target: under 2%)")


if __name__ == "__main__":
    main()
