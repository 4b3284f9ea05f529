"""``python -m benchmarks.hook_overhead [--hooks 5] [--rounds 4] [--rows N] [--epochs N]``

What no-op hooks cost a step, through the public API: warm fits of one rank (``local[1]``)
on the reference MLP with the probe hook alone and with ``--hooks`` hooks that override each
per-step stage with ``pass``, interleaved A B B A; the rank's CPU time per step (target: the
hooks cost under 2% of a step).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from benchmarks.common import Probe, Workload, register_by_value, spark_session, write_data
from benchmarks.contenders import timed_fit, touch
from spark_torch_est import Hook


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


def measure(rows: int, epochs: int, hooks: int, rounds: int) -> dict:
    """CPU microseconds per step without and with the no-op hooks, one list per side."""
    register_by_value()
    per_step: dict[int, list[float]] = {0: [], hooks: []}
    with tempfile.TemporaryDirectory(prefix="bench-hooks-") as scratch, spark_session(1, "bench-hooks") as spark:
        workload = write_data(Workload(rows=rows, epochs=epochs, ranks=1, files=1), scratch)
        df = spark.read.parquet(workload.path)
        timed_fit(workload, df, Probe(scratch, "warm-up"), duration="20ba")
        for number in range(rounds):
            for count in ((0, hooks) if number % 2 == 0 else (hooks, 0)):
                touch(workload.path)
                figures, _ = timed_fit(workload, df, Probe(scratch, f"{number}-{count}"),
                                       hooks=tuple(NoOp() for _ in range(count)))
                per_step[count].append(figures["cpu_us_per_sample"] * workload.batch_size)
    return per_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hook_overhead",
                                     description="What no-op hooks cost a step, through the public hook API")
    parser.add_argument("--hooks", type=int, default=5, help="no-op hooks (default 5)")
    parser.add_argument("--rounds", type=int, default=4, help="fits of each side, A B B A (default 4)")
    parser.add_argument("--rows", type=int, default=100_000, help="rows (default 100,000)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per fit (default 2)")
    args = parser.parse_args(argv)
    per_step = measure(args.rows, args.epochs, args.hooks, args.rounds)
    base, hooked = statistics.median(per_step[0]), statistics.median(per_step[args.hooks])
    spread = max(per_step[0]) / min(per_step[0]) - 1
    print(f"one rank (local[1], 1 thread), {args.rows:,} rows x {args.epochs} epochs, batch 256, "
          f"median of {args.rounds} fits each, interleaved:")
    for label, values in (("probe hook alone", per_step[0]),
                          (f"probe + {args.hooks} no-op hooks", per_step[args.hooks])):
        print(f"  {label:<24} {statistics.median(values):8.1f} CPU us per step "
              f"({', '.join(f'{v:.0f}' for v in values)})")
    print(f"  {args.hooks} no-op hooks cost {hooked - base:+.1f} us per step, {100 * (hooked / base - 1):+.2f}% of a "
          f"step (target: under 2%; the fits without them spread by {100 * spread:.1f}%)")


if __name__ == "__main__":
    main()
