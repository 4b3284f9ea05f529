"""``python -m benchmarks [--quick] [--repeat N] [--skip KEY ...] [--write-docs] [--json PATH]``

Writes the workload's Parquet once, runs every contender in interleaved rounds (each in a
fresh process), and prints the machine, the tables and how much other load there was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.dataset import write_parquet
from benchmarks.docs import DOCS_PATH, write_results
from benchmarks.machine import ForeignLoad, describe
from benchmarks.report import build_tables, load_summary
from benchmarks.suite import CONTENDERS, failures, run_rounds
from benchmarks.workload import Workload

_DISTURBED_CORES = 0.25


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Runs every contender in interleaved rounds, each in a fresh process, and prints the tables.",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 20k rows, 1 epoch")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--skip", nargs="*", default=[], choices=[c.key for c in CONTENDERS],
                        help="contenders to leave out")
    parser.add_argument("--write-docs", action="store_true", help=f"write the tables into {DOCS_PATH}")
    parser.add_argument("--json", metavar="PATH", help="also write every raw result to PATH")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    return args


def _environment() -> None:
    """Executors run this interpreter and everything binds to loopback (as `make bench`)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def _header(workload: Workload, args: argparse.Namespace) -> str:
    machine = "\n".join(f"- {name}: {value}" for name, value in describe().items())
    quick = " (quick: smoke-test size, not the reference workload)" if args.quick else ""
    return (
        f"Run {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: "
        f"`python -m benchmarks {shlex.join(sys.argv[1:])}`{quick}\n\n"
        f"{machine}\n\n"
        f"Workload: {workload.rows:,} rows x {workload.features} float32 features (Parquet), MLP "
        f"{workload.features}-{workload.hidden}-{workload.hidden}-1, SGD lr {workload.lr}, batch "
        f"{workload.batch_size} per rank, {workload.epochs} epoch(s), {workload.ranks} ranks x 1 thread, "
        f"local[{workload.ranks}]; {args.repeat} interleaved round(s), medians [min-max]."
    )


def _load_note(foreign_cpu_s: float, wall_s: float, worst: float, where: str) -> str:
    average = foreign_cpu_s / wall_s
    note = (f"Other processes used {average:.2f} cores on average during the run "
            f"(most: {worst:.2f} cores, during {where}). Total time {wall_s / 60:.1f} min.")
    if average > _DISTURBED_CORES or worst > 2 * _DISTURBED_CORES:
        note += " **Timings are disturbed by other load on this machine: rerun on an idle one.**"
    return note


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    _environment()
    workload = Workload.quick() if args.quick else Workload()
    contenders = [c for c in CONTENDERS if c.key not in args.skip]
    header = _header(workload, args)
    print(header + "\n", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spark-torch-est-bench-") as directory, ForeignLoad() as load:
        workload = dataclasses.replace(workload, path=write_parquet(workload, directory))
        rounds = run_rounds(workload, contenders, args.repeat, load,
                            log=lambda line: print(line, file=sys.stderr, flush=True))
    wall = time.perf_counter() - started
    tables = "\n\n".join(table.markdown() for table in build_tables(rounds, workload, contenders))
    note = _load_note(load.cpu_s, wall, *load_summary(rounds, contenders))
    print(f"{tables}\n\n{note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": dataclasses.asdict(workload), "rounds": rounds}, indent=1))
    if args.write_docs:
        write_results(f"{header}\n\n{tables}\n\n{note}")
        print(f"\nwrote {DOCS_PATH}")
    failed = failures(rounds)
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their output is above)")


if __name__ == "__main__":
    main()
