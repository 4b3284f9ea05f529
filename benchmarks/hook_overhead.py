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
from pyspark.sql import types as T

from spark_torch_est.creators import Creators
from spark_torch_est.barrier import LocalBarrier
from spark_torch_est.frames import input_schema
from spark_torch_est.hooks import normalize_hooks
from spark_torch_est.progress import Target
from spark_torch_est.protocol import FEATURES, LABEL
from spark_torch_est.spec import Launch, TaskSpec
from spark_torch_est.worker import run_rank

_LAUNCH = Launch(job_id="bench", secret=b"b" * 32)
# The schema the estimator derives for featuresCol="features" over an array<float> column.
_SCHEMA = input_schema(T.StructType([T.StructField("features", T.ArrayType(T.FloatType()))]),
                       features_col="features", feature_cols=None, input_cols=None)


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
    spec = _spec(creators, epochs)
    started = time.process_time()  # CPU time of this single-threaded loop: other load barely moves it
    run_rank(spec, _LAUNCH, iter(batches), LocalBarrier())
    return time.process_time() - started


def _spec(creators: Creators, epochs: int) -> TaskSpec:
    return TaskSpec(run_id="0123456789ab", fit_id="bench", payload=cloudpickle.dumps(creators), resume=None,
                    target=Target(epoch=epochs), schema=_SCHEMA, world_size=1, batch_size=256, seed=0, timeout_s=60)


def _dispatch_us(stages: tuple[str, ...]) -> float:
    """Microseconds the loop spends per step calling five no-op hooks: building each
    stage's arguments and dispatching them (the loop's own ``_call``)."""
    from spark_torch_est.loop import Trainer

    creators = Creators(model=_model, optimizer=None, loss=None, hooks=normalize_hooks([NoOp() for _ in range(5)]))
    trainer = Trainer(creators, _spec(creators, 1), shard=None, rank=0, world_size=1, device=torch.device("cpu"))
    batch = torch.zeros(1)
    step = {"batch": (batch, batch), "inputs": batch, "labels": batch, "outputs": batch, "loss": batch}
    trainer._run_args.update(model=None, ddp_model=None, optimizer=None, scheduler=None, loss_fn=None)
    calls = 20_000
    started = time.perf_counter()
    for _ in range(calls):
        for stage in stages:
            trainer._call(stage, 0, **step)
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
