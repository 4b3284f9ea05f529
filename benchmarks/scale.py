"""``python -m benchmarks.scale [--quick] [--rows N ...] [--repeat N] [--write-docs]``

How the call to the first optimizer step grows with the table: for each size of the suite's
ingest table, written one at a time, rounds of the ``pyarrow`` contender and of the ``ingest``
one's cold and warm fits. 8M rows are ~1 GB on disk and ~2.5 GB in the pyarrow process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time

from benchmarks.__main__ import WORKLOADS
from benchmarks.common import markdown, run_child, run_header, show, write_data, write_docs

SIZES = (500_000, 2_000_000, 4_000_000, 8_000_000)
QUICK_SIZES = (50_000, 200_000)
RSS_SLACK_MB = 400  # what a rank holding almost no rows peaks at, roughly (torch, pyarrow, pyspark)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale",
                                     description="Call to the first step against pyarrow's read as the table grows")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_SIZES} rows")
    parser.add_argument("--rows", type=int, nargs="+", help=f"the sizes (default {SIZES})")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds per size (default 1)")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    base = dataclasses.replace(WORKLOADS["ingest"], row_group=50_000 if args.quick else 1_000_000)
    sizes = args.rows or (QUICK_SIZES if args.quick else SIZES)
    rows_and_workload = f"{' / '.join(f'{n:,}' for n in sizes)} rows{base.describe().split(' rows', 1)[1]}"
    header = run_header("benchmarks.scale", rows_and_workload) + f"\n{args.repeat} round(s) per size."
    print(header + "\n", flush=True)
    started, rows = time.perf_counter(), []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="spark-torch-est-scale-") as directory:
            workload = write_data(dataclasses.replace(base, rows=size), directory)
            spec = json.dumps(dataclasses.asdict(workload))
            rounds = [(run_child("contenders", "pyarrow", spec), run_child("contenders", "ingest", spec, "cold,warm"))
                      for _ in range(args.repeat)]
        print(f"{size:,} rows done after {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        share = workload.table_mb / workload.ranks
        rss = [fits["cold_peak_rss_mb"] for _, fits in rounds]
        rows.append([f"{size:,}", show([read["parquet_mb"] for read, _ in rounds], " MB"),
                     show([fits["partitions"] for _, fits in rounds]),
                     show([read["read_s"] for read, _ in rounds], " s"),
                     show([fits["warm_first_step_s"] for _, fits in rounds], " s"),
                     show([fits["warm_first_step_s"] / read["read_s"] for read, fits in rounds], "x"),
                     show([fits["cold_first_step_s"] for _, fits in rounds], " s"), show(rss, " MB"),
                     f"{share:,.0f} MB", "yes" if max(rss) <= 1.5 * share + RSS_SLACK_MB else "NO"])
    table = markdown(["Rows", "Parquet", "Spark partitions", "pyarrow read into numpy", "warm call to 1st step",
                      "ratio to the read", "cold call to 1st step", "largest rank's peak RSS (cold)",
                      "its share of the data", f"RSS <= 1.5x share + {RSS_SLACK_MB} MB"], rows)
    text = f"{header}\n\n{table}\n\nTotal {(time.perf_counter() - started) / 60:.1f} min."
    print(text)
    if args.write_docs:
        write_docs(text, "scale")


if __name__ == "__main__":
    main()
