"""``python -m benchmarks [--quick] [--repeat N] [--only KEY ...] [--baseline CHECKOUT] [--write-docs]``

Runs every contender of :data:`CONTENDERS` in interleaved rounds, each a fresh process
(:mod:`benchmarks.contenders`), and prints :data:`COMPARISONS` (ratios taken within a round)
and every figure; ``--baseline`` adds :data:`AGAINST_BASELINE`. Exits non-zero when a
contender fails or when ``TorchEstimator`` did not do the same work as bare DDP (its final loss).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Collection

from benchmarks.common import (
    Workload,
    add_baseline,
    baseline_of,
    markdown,
    run_child,
    run_header,
    show,
    write_data,
    write_docs,
)

WORKLOADS = {
    "reference": Workload(),
    "recommender": Workload(kind="rec", rows=1_000_000, features=13, hidden=64, epochs=1, lr=0.05),
    "ingest": Workload(rows=4_000_000, epochs=1, files=0, steps=20),
}
QUICK = {"reference": {"rows": 20_000, "epochs": 1}, "recommender": {"rows": 50_000},
         "ingest": {"rows": 200_000, "row_group": 50_000}}

#: key: (contender in benchmarks.contenders, workload, label). A round runs them in this order.
CONTENDERS = {
    "plain": ("plain", "reference", "plain torch, 1 process, every core"),
    "ddp": ("ddp", "reference", "bare DDP (spawn, gloo)"),
    "td_local": ("td_local", "reference", "TorchDistributor local_mode=True"),
    "td_barrier": ("td_barrier", "reference", "TorchDistributor local_mode=False"),
    "te": ("te", "reference", "TorchEstimator"),
    "rec_ddp": ("ddp", "recommender", "bare DDP, recommender"),
    "rec_te": ("te", "recommender", "TorchEstimator, recommender (inputCols)"),
    "pyarrow": ("pyarrow", "ingest", "pyarrow read_table into numpy, 1 process"),
    "ingest": ("ingest", "ingest", "TorchEstimator, ingest table"),
}

PLAIN_FORWARD = ("ingest", "transform_plain_rows_per_s", "plain batched forward, 1 process")
#: (figure, ours (contender, field), reference (contender, field[, label]), target on the ratio).
COMPARISONS = [
    *[(f"fit wall time, {when}", ("te", f"{when}_wall_s"), (peer, f"{when}_wall_s"), target)
      for peer in ("td_local", "td_barrier") for when, target in (("cold", "<=0.7"), ("warm", "<=0.5"))],
    *[(f"call to first step, {when}", ("te", f"{when}_first_step_s"), (peer, f"{when}_first_step_s"), "")
      for peer in ("td_local", "td_barrier") for when in ("cold", "warm")],
    ("loop samples/s (warm fit)", ("te", "warm_samples_per_s"), ("ddp", "samples_per_s"), ">=0.95"),
    ("loop CPU us per sample, rank 0", ("te", "warm_cpu_us_per_sample"), ("ddp", "cpu_us_per_sample"), ""),
    ("loop samples/s against one process", ("te", "warm_samples_per_s"), ("plain", "samples_per_s"), ""),
    ("final loss, 20k rows (the same work)", ("te", "loss"), ("ddp", "loss"), "<=1.1"),
    ("recommender: loop samples/s", ("rec_te", "warm_samples_per_s"), ("rec_ddp", "samples_per_s"), ">=0.95"),
    ("recommender: loop CPU us per sample", ("rec_te", "warm_cpu_us_per_sample"), ("rec_ddp", "cpu_us_per_sample"), ""),
    ("recommender: final loss (the same work)", ("rec_te", "loss"), ("rec_ddp", "loss"), "<=1.1"),
    ("ingest: call to first step, warm, direct read", ("ingest", "warm_first_step_s"), ("pyarrow", "read_s"), "<=2.0"),
    ("ingest: call to first step, cold, direct read", ("ingest", "cold_first_step_s"), ("pyarrow", "read_s"), ""),
    ("ingest: call to first step, directRead=False", ("ingest", "spark_first_step_s"), ("pyarrow", "read_s"), ""),
    ("ingest: first fit on df.cache()", ("ingest", "cache_first_first_step_s"), ("pyarrow", "read_s"), ""),
    ("ingest: second fit on df.cache()", ("ingest", "cache_second_first_step_s"), ("pyarrow", "read_s"), ""),
    ("ingest: transform rows/s, tasks read the files", ("ingest", "transform_files_rows_per_s"), PLAIN_FORWARD,
     ">=0.5"),
    ("ingest: transform rows/s, through Spark's scan", ("ingest", "transform_spark_rows_per_s"), PLAIN_FORWARD, ""),
]
#: Figures of this checkout against ``--baseline``'s, per TorchEstimator contender: a cost of
#: the loop within 1.05x of the baseline's is a samples/s ratio of at least 0.952.
AGAINST_BASELINE = {
    "te": [("loop samples/s (warm fit)", "warm_samples_per_s", ">=0.952"), ("fit wall time, warm", "warm_wall_s", ""),
           ("call to first step, cold", "cold_first_step_s", ""), ("call to first step, warm", "warm_first_step_s", ""),
           ("peak RSS of a rank, warm fit", "warm_peak_rss_mb", "")],
    "rec_te": [("recommender: loop samples/s", "warm_samples_per_s", ">=0.952"),
               ("recommender: peak RSS of a rank", "warm_peak_rss_mb", "")],
    "ingest": [(f"ingest: {what}, {fit} fit", f"{fit}_{field}", "")
               for fit in ("warm", "spark") for what, field in (("call to first step", "first_step_s"),
                                                                 ("peak RSS of a rank", "peak_rss_mb"))],
}
BASELINE = "then_"  # key prefix of the baseline's contenders

#: Targets that fail the run when missed: the same work, not the timings of a shared machine.
MUST = ("final loss",)


def value(results: dict, pick: tuple[str, ...]) -> float | None:
    """One round's figure ``pick[1]`` of contender ``pick[0]``, or None."""
    return results.get(pick[0], {}).get(pick[1])


def met(figure: float | None, target: str) -> str:
    """Whether ``figure`` meets ``target`` (``"<=1.3"``, ``">=0.95"``): "yes", "NO", or "-"."""
    if not target or figure is None:
        return "-"
    bound = float(target[2:])
    return "yes" if (figure <= bound if target.startswith("<=") else figure >= bound) else "NO"


def comparisons(rounds: list[dict], baseline: str | None = None) -> tuple[str, list[str]]:
    """The comparison table and the figures whose :data:`MUST` target was missed."""
    rows, missed = [], []
    against = [(f"{figure}, against the baseline", (key, field), (BASELINE + key, field, "the baseline"), target)
               for key, figures in AGAINST_BASELINE.items() for figure, field, target in figures] if baseline else []
    for figure, ours, ref, target in COMPARISONS + against:
        if not any(value(r, ours) is not None and value(r, ref) is not None for r in rounds):
            continue
        ratios = [value(r, ours) / value(r, ref) for r in rounds if value(r, ours) and value(r, ref)]
        verdict = met(statistics.median(ratios), target)
        if verdict == "NO" and figure.startswith(MUST):
            missed.append(figure)
        rows.append([figure, show([value(r, ours) for r in rounds]), (ref[2:] or CONTENDERS[ref[0]][2:])[0],
                     show([value(r, ref) for r in rounds]), show(ratios, "x"), target and target + "x" or "-",
                     verdict])
    header = ["Figure", "TorchEstimator", "Reference", "Reference value", "Ratio", "Target", "Met"]
    return markdown(header, rows), missed


def every_figure(rounds: list[dict], table: dict = CONTENDERS) -> str:
    """Every figure of every contender of ``table``, over the rounds."""
    rows = []
    keys = dict.fromkeys(key for r in rounds for key in r)
    for key in keys:
        label = table[key.removeprefix(BASELINE)][2] + (" (baseline)" if key.startswith(BASELINE) else "")
        fields = dict.fromkeys(field for r in rounds for field in r.get(key, {}) if field != "error")
        rows += [[label, field, show([r.get(key, {}).get(field) for r in rounds])] for field in fields]
    return markdown(["Contender", "Figure", "Value"], rows)


def run_rounds(contenders: list[str], workloads: dict[str, Workload], repeat: int, baseline: str | None = None,
               table: dict = CONTENDERS, on_baseline: Collection[str] = tuple(AGAINST_BASELINE)) -> list:
    """``repeat`` rounds of every contender of ``table`` named in ``contenders``, each a fresh
    process; ``{key: figures}`` per round (``{"error": ...}`` for a contender that failed: the
    others still run). A contender is ``(name in benchmarks.contenders, workload, label, *its
    arguments)``. With ``baseline``, each contender in ``on_baseline`` is followed by the same
    one on that checkout's package."""
    rounds = []
    runs = [(key, None) for key in contenders]
    if baseline:
        runs = [run for key in contenders for run in [(key, None)] + [(BASELINE + key, baseline)] * (
            key in on_baseline)]
    for number in range(1, repeat + 1):
        results = {}
        for key, package in runs:
            name, workload, label, *args = table[key.removeprefix(BASELINE)]
            label += " (baseline)" if package else ""
            started = time.perf_counter()
            try:
                results[key] = run_child("contenders", name, json.dumps(dataclasses.asdict(workloads[workload])),
                                         *args, package=package)
            except Exception as error:  # noqa: BLE001 - reported, and the run exits non-zero
                results[key] = {"error": str(error)}
                print(error, file=sys.stderr)
            print(f"round {number}/{repeat}: {label:<45} {time.perf_counter() - started:6.1f} s", file=sys.stderr,
                  flush=True)
        rounds.append(results)
    return rounds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description="TorchEstimator against its peers and pyarrow, side by side")
    parser.add_argument("--quick", action="store_true", help="smoke run: small tables, 1 epoch, 1 round")
    parser.add_argument("--repeat", type=int, help="interleaved rounds (default 2, --quick 1)")
    parser.add_argument("--only", nargs="+", choices=list(CONTENDERS), help="run only these contenders")
    add_baseline(parser)
    parser.add_argument("--write-docs", action="store_true", help="write the tables into docs/benchmarks.md")
    args = parser.parse_args(argv)
    baseline = baseline_of(parser, args)
    repeat = args.repeat or (1 if args.quick else 2)
    contenders = args.only or list(CONTENDERS)
    needed = {CONTENDERS[key][1] for key in contenders}
    workloads = {name: dataclasses.replace(w, **QUICK[name]) if args.quick else w
                 for name, w in WORKLOADS.items() if name in needed}
    facts = [f"{name}: {w.describe()}" for name, w in workloads.items()]
    if baseline:
        facts.append(f"baseline: `spark_torch_est` from {baseline}")
    header = (run_header("benchmarks", *facts)
              + f"\n{repeat} interleaved round(s): median [min-max]; ratios taken within each round.")
    print(header + "\n", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spark-torch-est-bench-") as directory:
        workloads = {name: write_data(w, directory) for name, w in workloads.items()}
        rounds = run_rounds(contenders, workloads, repeat, baseline)
    table, missed = comparisons(rounds, baseline)
    text = (f"{header}\n\n{table}\n\nEvery figure (s: seconds from the call; loss: on the table's first 20k rows):"
            f"\n\n{every_figure(rounds)}\n\nTotal {(time.perf_counter() - started) / 60:.1f} min; load average at "
            f"the end {' '.join(f'{v:.2f}' for v in os.getloadavg())}.")
    print(text)
    if args.write_docs:
        write_docs(text, "results")
    failed = [key for r in rounds for key, figures in r.items() if "error" in figures]
    if failed or missed:
        sys.exit(f"failed: {', '.join(failed + missed)}")


if __name__ == "__main__":
    main()
