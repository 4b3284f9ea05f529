"""``python -m benchmarks.scale [--quick] [--rows N ...] [--repeat N] [--write-docs] [--json PATH]``

How the call to the first optimizer step grows with rows. For each size (default 0.5M,
2M, 4M and 8M rows x 32 float32, one Parquet file of 1M-row row groups, as the ingest
workload of ``python -m benchmarks``), writes the file into a temporary directory, runs
interleaved rounds of pyarrow reading it into numpy (:mod:`benchmarks.ingest_pyarrow`,
with and without ``pre_buffer``: the faster is the reference) and of ``TorchEstimator``'s
cold and warm fits with the ranks reading the files (and one on the unchanged files)
(:mod:`benchmarks.ingest_estimator`, variant ``scale``), each a fresh process, then
deletes the file before the next size. Prints one table (``--write-docs``: also into
``docs/benchmarks.md``). 8M rows are ~1 GB on disk and ~2.5 GB in the pyarrow process.
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

from benchmarks.dataset import write_table_file
from benchmarks.docs import DOCS_PATH, write_results
from benchmarks.machine import ForeignLoad, describe_markdown, load_note
from benchmarks.protocol import use_local_environment
from benchmarks.report import load_summary
from benchmarks.report_ingest import RSS_SLACK_MB, faster_read
from benchmarks.suite import Contender, failures, run_rounds
from benchmarks.tables import Round, Summary, Table, get, largest, mb, ratio, seconds, times
from benchmarks.workload import IngestWorkload

__all__ = ["main"]

SIZES = (500_000, 2_000_000, 4_000_000, 8_000_000)
QUICK_SIZES = (50_000, 200_000)
CONTENDERS = (
    Contender("ingest_pyarrow", "ingest_pyarrow", "", "pyarrow into numpy", "ingest"),
    Contender("ingest_pyarrow_default", "ingest_pyarrow", "default", "pyarrow defaults into numpy", "ingest"),
    Contender("ingest_te", "ingest_estimator", "scale", "TorchEstimator, direct read", "ingest"),
)
_HEADER = ["Rows", "Parquet", "Spark partitions", "pyarrow into numpy: pre_buffer=False / defaults",
           "warm call to 1st step", "ratio to the faster read", "the same, unchanged files", "cold call to 1st step",
           "largest rank's peak RSS (cold)", "its share of the data", f"RSS <= 1.5x share + {RSS_SLACK_MB} MB"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale",
                                     description="Call to first step against pyarrow's read, for growing tables.")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {', '.join(map(str, QUICK_SIZES))} rows")
    parser.add_argument("--rows", type=int, nargs="+", help=f"the sizes (default {' '.join(map(str, SIZES))})")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds per size (default 1)")
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {DOCS_PATH}")
    parser.add_argument("--json", metavar="PATH", help="also write every raw result to PATH")
    args = parser.parse_args(argv)
    if args.repeat < 1 or any(rows < 2 for rows in args.rows or ()):
        parser.error("--repeat must be at least 1 and every --rows at least 2")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    use_local_environment()
    sizes = args.rows or (QUICK_SIZES if args.quick else SIZES)
    base = IngestWorkload.quick() if args.quick else IngestWorkload()
    header = (f"Run {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: `python -m benchmarks.scale "
              f"{shlex.join(sys.argv[1:])}`\n\n{describe_markdown()}\n\n"
              f"- {base.describe(rows=' / '.join(f'{rows:,}' for rows in sizes))}\n\n"
              f"{args.repeat} interleaved round(s) per size, medians [min-max].")
    print(header + "\n", flush=True)
    started, results, worst = time.perf_counter(), {}, (0.0, "-")
    with ForeignLoad() as load:
        for rows in sizes:
            with tempfile.TemporaryDirectory(prefix="spark-torch-est-scale-") as directory:
                workload = dataclasses.replace(base, rows=rows)
                workload = dataclasses.replace(workload, path=write_table_file(workload, directory))
                results[rows] = run_rounds({"ingest": workload}, list(CONTENDERS), args.repeat, load,
                                           log=lambda line, rows=rows: print(f"{rows:,} rows, {line}",
                                                                            file=sys.stderr, flush=True))
            cores, where = load_summary(results[rows], list(CONTENDERS))
            worst = max(worst, (cores, f"{where}, {rows:,} rows"))
    wall = time.perf_counter() - started
    table = _table(results, base).markdown()
    note = load_note(load.cpu_s, wall, *worst)
    print(f"{table}\n\n{note}")
    if args.json:
        Path(args.json).write_text(json.dumps({str(rows): rounds for rows, rounds in results.items()}, indent=1))
    if args.write_docs:
        write_results(f"{header}\n\n{table}\n\n{note}", block="scale")
        print(f"\nwrote {DOCS_PATH}")
    failed = [f"{rows:,} rows: {failure}" for rows, rounds in results.items() for failure in failures(rounds)]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their output is above)")


def _table(results: dict[int, list[Round]], base: IngestWorkload) -> Table:
    rows = []
    warm = get("ingest_te", "warm", "first_step_s")
    peak = largest(get("ingest_te", "cold", "peak_rss_mb"))
    for size, rounds in results.items():
        summary = Summary(rounds)
        share = dataclasses.replace(base, rows=size).share_mb
        rss = summary.median(peak)
        rows.append([
            f"{size:,}", summary.show(get("ingest_pyarrow", "parquet_mb"), mb),
            summary.show(get("ingest_te", "partitions"), lambda value: f"{value:.0f}"),
            f"{summary.show(get('ingest_pyarrow', 'read_s'), seconds)} / "
            f"{summary.show(get('ingest_pyarrow_default', 'read_s'), seconds)}",
            summary.show(warm, seconds), summary.show(ratio(warm, faster_read), times),
            summary.show(get("ingest_te", "reuse", "first_step_s"), seconds),
            summary.show(get("ingest_te", "cold", "first_step_s"), seconds), summary.show(peak, mb), mb(share),
            "n/a" if rss is None else "yes" if rss <= 1.5 * share + RSS_SLACK_MB else "NO",
        ])
    return Table("Call to first optimizer step as the table grows (direct read; warm = the session's second fit, "
                 "after the files were touched so that it reads them; then a third fit on the unchanged files)",
                 _HEADER, rows)


if __name__ == "__main__":
    main()
