"""``python -m benchmarks [--quick] [--repeat N] [--skip KEY ...] [--write-docs] [--json PATH]``

Writes each workload's Parquet once (into a temporary directory, deleted at the end),
runs every contender in interleaved rounds (each in a fresh process), and prints the
machine, the tables and how much other load there was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.docs import DOCS_PATH, write_results
from benchmarks.machine import ForeignLoad, describe_markdown, load_note
from benchmarks.protocol import use_local_environment
from benchmarks.report import build_tables, load_summary
from benchmarks.suite import CONTENDERS, WORKLOADS, Contender, failures, run_rounds
from benchmarks.workload import WorkloadBase


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Runs every contender in interleaved rounds, each in a fresh process, and prints the tables.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 20k rows and 1 epoch, a 50k-row recommender, a 200k-row ingest table")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--skip", nargs="*", default=[], choices=[c.key for c in CONTENDERS],
                        help="contenders to leave out")
    parser.add_argument("--write-docs", action="store_true", help=f"write the tables into {DOCS_PATH}")
    parser.add_argument("--json", metavar="PATH", help="also write every raw result to PATH")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    return args


def _workloads(contenders: list[Contender], quick: bool) -> dict[str, WorkloadBase]:
    """The sizes of the workloads the contenders need (their paths are set once written)."""
    needed = dict.fromkeys(c.workload for c in contenders)
    return {name: (WORKLOADS[name][0].quick() if quick else WORKLOADS[name][0]()) for name in needed}


def _write(workloads: dict[str, WorkloadBase], directory: str) -> dict[str, WorkloadBase]:
    return {name: dataclasses.replace(workload, path=WORKLOADS[name][1](workload, directory))
            for name, workload in workloads.items()}


def _header(workloads: dict[str, WorkloadBase], args: argparse.Namespace) -> str:
    machine = describe_markdown()
    quick = " (quick: smoke-test sizes, not the benchmark workloads)" if args.quick else ""
    lines = [workload.describe() for workload in workloads.values()]
    return (
        f"Run {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: "
        f"`python -m benchmarks {shlex.join(sys.argv[1:])}`{quick}\n\n"
        f"{machine}\n\n" + "\n".join(f"- {line}" for line in lines) + "\n\n"
        f"{args.repeat} interleaved round(s), medians [min-max]."
    )


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    use_local_environment()
    contenders = [c for c in CONTENDERS if c.key not in args.skip]
    workloads = _workloads(contenders, args.quick)
    header = _header(workloads, args)
    print(header + "\n", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spark-torch-est-bench-") as directory, ForeignLoad() as load:
        workloads = _write(workloads, directory)
        rounds = run_rounds(workloads, contenders, args.repeat, load,
                            log=lambda line: print(line, file=sys.stderr, flush=True))
    wall = time.perf_counter() - started
    tables = "\n\n".join(table.markdown() for table in build_tables(rounds, workloads, contenders))
    note = load_note(load.cpu_s, wall, *load_summary(rounds, contenders))
    print(f"{tables}\n\n{note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"workloads": {name: dataclasses.asdict(workload)
                                                             for name, workload in workloads.items()},
                                               "rounds": rounds}, indent=1))
    if args.write_docs:
        write_results(f"{header}\n\n{tables}\n\n{note}")
        print(f"\nwrote {DOCS_PATH}")
    failed = failures(rounds)
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their output is above)")


if __name__ == "__main__":
    main()
