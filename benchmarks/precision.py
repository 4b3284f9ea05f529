"""``python -m benchmarks.precision [--rows N] [--epochs N] [--rounds N]``: the loop under
``precision`` "32" and "bf16-mixed", with and without ``compileModel``, against the plain
torch loop doing the same, on the CPU: one rank of the reference workload, ``local[1]``
against :func:`benchmarks.common.plain_train` in this process with the same autocast and
``torch.compile(..., dynamic=False)``, in interleaved rounds. Inductor's on-disk caches are
off (here and in the executors), so every fit compiles.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"  # before torch reads it, here and (inherited) in the executors
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"

import torch  # noqa: E402

from benchmarks.common import Probe, Workload, markdown, plain_train, read_rank, spark_session, write_data  # noqa: E402
from benchmarks.contenders import timed_fit, touch  # noqa: E402

CONFIGS = (("32", False), ("bf16-mixed", False), ("32", True), ("bf16-mixed", True))
AUTOCAST = {"32": None, "bf16-mixed": torch.bfloat16}


def _plain(workload: Workload, precision: str, compiled: bool) -> dict:
    inputs, labels = read_rank(workload, 0, 1)
    called, first = time.time(), None
    model, optimizer = workload.build()
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model, dynamic=False)
    for _ in range(workload.epochs):  # one clock per epoch: the last one is timed
        clock = plain_train(model, optimizer, inputs, labels, workload.loss_fn(), epochs=1,
                            batch_size=workload.batch_size, seed=workload.seed, autocast=AUTOCAST[precision])
        first = first or clock.first
    return {**clock.figures(called), "first_step_s": first - called}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.precision", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=2, help="at least 2: the last one is timed")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as scratch, \
            spark_session(1, "bench-precision") as spark:
        workload = write_data(Workload(rows=args.rows, epochs=args.epochs, ranks=1, files=1), scratch)
        df = spark.read.parquet(workload.path)
        timed_fit(workload, df, Probe(scratch, "warm-up"), duration="8ba")  # the session's first job: not timed
        for number in range(args.rounds):
            for precision, compiled in CONFIGS:
                for who in (("ours", "plain") if number % 2 == 0 else ("plain", "ours")):
                    if who == "plain":
                        figures = _plain(workload, precision, compiled)
                    else:
                        touch(workload.path)
                        figures, _ = timed_fit(workload, df, Probe(scratch, f"{number}{precision}{compiled}", True),
                                               precision=precision, compileModel=compiled)
                    results.setdefault((precision, compiled, who), []).append(figures)
    print(f"one rank on the CPU, {args.rows:,} rows x 32 float32, MLP 32-256-256-1, SGD, batch 256, {args.epochs} "
          f"epochs, 1 thread, median of {args.rounds} interleaved rounds\n")
    rows = []
    for precision, compiled in CONFIGS:
        medians = {who: {key: statistics.median(r[key] for r in results[(precision, compiled, who)])
                         for key in ("first_step_s", "samples_per_s", "cpu_us_per_sample")}
                   for who in ("plain", "ours")}
        for who, name in (("plain", "plain torch"), ("ours", "TorchEstimator")):
            m = medians[who]
            rows.append([precision, "yes" if compiled else "no", name, f"{m['first_step_s']:.2f}",
                         f"{m['samples_per_s']:,.0f}", f"{m['cpu_us_per_sample']:.2f}",
                         f"{m['cpu_us_per_sample'] / medians['plain']['cpu_us_per_sample']:.2f}x"])
    print(markdown(["precision", "compiled", "contender", "first step s", "samples/s", "CPU us/sample", "vs plain"],
                   rows))


if __name__ == "__main__":
    main()
