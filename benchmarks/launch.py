"""``python -m benchmarks.launch [--quick] [--rows N ...] [--repeat N] [--only KEY ...] [--baseline CHECKOUT]
[--write-docs]``

The launch of a fit, every row of issue 43's table in one run: each contender a fresh process
(:mod:`benchmarks.contenders`), in interleaved rounds; with ``--baseline``, each ``TorchEstimator``
contender runs on that checkout's package right after this one's, and the table adds the
baseline's figure and the ratio of the two, taken within each round. Sizes are the suite's
ingest table (4M rows x 32 float32; ``--quick``: 200k rows). The figures:

- **Files read again / pyarrow's read** and **peak RSS for the share**: the suite's ``ingest``
  contender (a cold fit, then a warm one on touched files, 2 ranks) against its ``pyarrow`` one;
  the warm fit's largest rank's peak RSS against 1.5 shares + 400 MB, as in :mod:`benchmarks.scale`
  (a share: the table's rows as float32 over the ranks).
- **First fit through Spark / Spark's own scan** (``contenders.through_spark``), on ``local[W]``
  for W = 2 and 1: the call to the first step of the first fit of a cached, computed DataFrame
  over the table, against the faster of two scans of that cached DataFrame into Arrow batches
  in W Python tasks (``coalesce(W).mapInArrow`` reading every batch, into the ``noop`` sink), one
  before the fit and one after. The scan is what any way through Spark's Python workers pays;
  the fit adds the repartition, the rows' layout, keeping them and the launch. The Python
  workers have started and imported ``spark_torch_est`` before either is timed.
- **Peak above one share while the layout is built** (``contenders.layout``) at 2M and 4M rows
  (``--rows``; ``--quick``: 200k): fits through Spark (``directRead=False``) on 2 and 3 ranks, and runs on
  the files read directly continued on another number of ranks (2 then 3, 3 then 2: rows move
  between ranks at the second fit's launch), with the first fits of those runs (as many ranks as
  logical shards: no row moves) for reference. Before each of these fits a fit of 1,000 rows on
  every slot makes each Python worker drop the rows it held; the driver then resets each
  worker's peak RSS (``/proc/<pid>/clear_refs``) and reads its RSS, and each rank reads its peak
  (``VmHWM``) at its first step. The figure is the largest rise over the ranks, peak minus RSS
  before, in shares of the table (float32 rows / ranks), minus one: 0 is a rank that held its
  rows once and nothing more. It includes what the launch adds besides rows (the process group,
  the model, the first step; the reference rows show how much); goal: one round of the move,
  about 2 MB per other rank.
- **16 ranks on local[16], cold**: the ``ingest`` contender's cold fit (a fresh session and
  Python workers, the files read directly) with ``numWorkers=16``; goal 20 s. Again with
  ``spark.python.daemon.module=spark_torch_est.daemon`` (the workers forked with torch
  imported), not run on the baseline, which has no such module.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from benchmarks.__main__ import BASELINE, WORKLOADS, every_figure, met, run_rounds, value
from benchmarks.common import Workload, add_baseline, baseline_of, markdown, run_header, show, write_data, write_docs
from benchmarks.scale import RSS_SLACK_MB

SIZES = (2_000_000, 4_000_000)
QUICK_SIZES = (200_000,)
QUICK = {"rows": 200_000, "row_group": 50_000}
MANY = 16
PRELOADING_DAEMON = "spark_torch_est.daemon"  # spark.python.daemon.module: workers start with torch imported
ROUND_MB = 2  # a round of the rows' move, per other rank

#: The layout table's fits: (contender key prefix, fit in ``contenders.layout``'s figures, how).
LAYOUT_FITS = (
    ("resized", "files_2", "files read directly, 2 ranks (reference: no row moves)"),
    ("resized", "files_3", "files read directly, 3 ranks (reference: no row moves)"),
    ("moved", "spark_2", "through Spark (directRead=False), 2 ranks"),
    ("moved", "spark_3", "through Spark (directRead=False), 3 ranks"),
    ("resized", "files_3_after_2", "files read directly, continued on 3 ranks after 2"),
    ("resized", "files_2_after_3", "files read directly, continued on 2 ranks after 3"),
)

#: A figure: (what, its value in one round for a key prefix ("" or the baseline's), unit, goal).
Figure = tuple[str, Callable[[dict, str], float | None], str, float]


def contenders(sizes: tuple[int, ...]) -> dict[str, tuple[str, ...]]:
    """key: (contender in benchmarks.contenders, workload, label, *its arguments), in the order
    a round runs them."""
    table = {
        "pyarrow": ("pyarrow", "ingest", "pyarrow read_table into numpy, 1 process"),
        "files": ("ingest", "ingest", "TorchEstimator, files read directly, 2 ranks", "cold,warm"),
        "spark_2": ("through_spark", "ingest", "TorchEstimator, first fit through Spark, 2 ranks"),
        "spark_1": ("through_spark", "ingest_1", "TorchEstimator, first fit through Spark, 1 rank"),
    }
    for size in sizes:
        table[f"moved_{size}"] = ("layout", f"rows_{size}", f"TorchEstimator, {size:,} rows through Spark", "spark")
        table[f"resized_{size}"] = ("layout", f"rows_{size}", f"TorchEstimator, {size:,} rows on other ranks", "resize")
    table["many"] = ("ingest", "many", f"TorchEstimator, {MANY} ranks on local[{MANY}]", "cold")
    table["preloaded"] = ("ingest", "many", f"TorchEstimator, {MANY} ranks on local[{MANY}], workers forked from "
                          f"{PRELOADING_DAEMON}", "cold", PRELOADING_DAEMON)
    return table


def workloads(sizes: tuple[int, ...], quick: bool) -> dict[str, Workload]:
    """The ingest table on 2, 1 and :data:`MANY` ranks, and at each of the layout's ``sizes``."""
    ingest = dataclasses.replace(WORKLOADS["ingest"], **QUICK) if quick else WORKLOADS["ingest"]
    return {"ingest": ingest, "ingest_1": dataclasses.replace(ingest, ranks=1),
            "many": dataclasses.replace(ingest, ranks=MANY),
            **{f"rows_{size}": dataclasses.replace(ingest, rows=size) for size in sizes}}


def figures(sizes: tuple[int, ...], loads: dict[str, Workload]) -> list[Figure]:
    """The table's rows, in the issue's order."""
    ingest = loads["ingest"]
    share = ingest.table_mb / ingest.ranks
    rows: list[Figure] = [
        (f"plain Parquet table ({ingest.rows:,} rows), files read again, 2 ranks: call to first step / pyarrow's "
         "own read", _ratio(("files", "warm_first_step_s"), ("pyarrow", "read_s")), "x", 1.0),
        (f"largest rank's peak RSS for its share ({share:,.0f} MB), files read again, 2 ranks",
         _figure("files", "warm_peak_rss_mb"), " MB", 1.5 * share + RSS_SLACK_MB),
        *[(f"first fit through Spark (a cached, computed DataFrame) / Spark's own scan into Arrow, {ranks}",
           _ratio((f"spark_{w}", "first_step_s"), (f"spark_{w}", "scan_s")), "x", 1.3)
          for w, ranks in ((2, "2 ranks"), (1, "1 rank"))],
    ]
    for size in sizes:
        for key, fit, how in LAYOUT_FITS:
            ranks = int(fit.split("_")[1])
            rows.append((f"peak above one share while the layout is built: {size:,} rows, {how}",
                         _figure(f"{key}_{size}", f"{fit}_above_share"), " shares",
                         ROUND_MB * (ranks - 1) / (loads[f"rows_{size}"].table_mb / ranks)))
    rows.append((f"{MANY} ranks on local[{MANY}], cold (fresh session and workers): call to first step",
                 _figure("many", "cold_first_step_s"), " s", 20.0))
    rows.append((f"same, the workers forked from {PRELOADING_DAEMON} (spark.python.daemon.module)",
                 _figure("preloaded", "cold_first_step_s"), " s", 20.0))
    return rows


def _figure(key: str, field: str) -> Callable[[dict, str], float | None]:
    return lambda results, prefix: value(results, (prefix + key, field))


def _ratio(top: tuple[str, str], bottom: tuple[str, str]) -> Callable[[dict, str], float | None]:
    """``top`` over ``bottom``, each the same checkout's, but pyarrow's read (run once a round)."""
    def ratio(results: dict, prefix: str) -> float | None:
        over = value(results, (prefix + top[0], top[1]))
        under = value(results, (("" if bottom[0] == "pyarrow" else prefix) + bottom[0], bottom[1]))
        return over / under if over is not None and under else None

    return ratio


def table(rounds: list[dict], rows: list[Figure], baseline: bool) -> str:
    """The figures of this checkout (and the baseline's, and their ratio within each round)
    against their goals."""
    header = ["Figure", "This checkout", *(["Baseline", "This / baseline"] if baseline else []), "Goal", "Met"]
    lines = []
    for figure, pick, unit, goal in rows:
        ours, then = [pick(r, "") for r in rounds], [pick(r, BASELINE) for r in rounds]
        if all(v is None for v in ours + then):  # its contender was not run (--only) or failed
            continue
        line = [figure, show(ours, unit)]
        if baseline:
            ratios = [a / b for a, b in zip(ours, then) if a is not None and b is not None and a > 0 and b > 0]
            line += [show(then, unit), show(ratios, "x") if ratios else "-"]
        known = [v for v in ours if v is not None]
        lines.append([*line, f"<={goal:.3g}{unit}", met(statistics.median(known), f"<={goal}") if known else "-"])
    return markdown(header, lines)


def _written(loads: dict[str, Workload], directory: str) -> dict[str, Workload]:
    """The workloads with their tables written under ``directory``, one table per size."""
    paths: dict[int, str] = {}
    for load in loads.values():
        if load.rows not in paths:
            paths[load.rows] = write_data(load, directory).path
    return {name: dataclasses.replace(load, path=paths[load.rows]) for name, load in loads.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launch",
                                     description="The launch of a fit: issue 43's table, side by side")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK['rows']:,} rows, 1 round")
    parser.add_argument("--rows", type=int, nargs="+", help=f"the layout's table sizes (default {SIZES})")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--only", nargs="+", metavar="KEY", help="only these contenders (an unknown key lists them)")
    add_baseline(parser)
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    baseline = baseline_of(parser, args)
    sizes = tuple(args.rows or (QUICK_SIZES if args.quick else SIZES))
    every = contenders(sizes)
    keys = args.only or list(every)
    if set(keys) - set(every):
        parser.error(f"--only: unknown {sorted(set(keys) - set(every))}; the keys are {', '.join(every)}")
    loads = workloads(sizes, args.quick)
    facts = [f"ingest: {loads['ingest'].describe()}",
             f"layout: {' and '.join(f'{n:,}' for n in sizes)} rows of that table, fits of one step, local[3]",
             f"{MANY} ranks: the ingest table read directly, local[{MANY}], numWorkers={MANY}"]
    if baseline:
        facts.append(f"baseline: `spark_torch_est` from {baseline}")
    header = (run_header("benchmarks.launch", *facts)
              + f"\n{args.repeat} round(s): median [min-max]; ratios taken within each round.")
    print(header + "\n", flush=True)
    started = time.perf_counter()
    needed = {every[key][1] for key in keys}
    with tempfile.TemporaryDirectory(prefix="spark-torch-est-launch-") as directory:
        written = _written({name: load for name, load in loads.items() if name in needed}, directory)
        rounds = run_rounds(keys, written, args.repeat, baseline, table=every,
                            on_baseline=[key for key in keys if key not in ("pyarrow", "preloaded")])
    report = f"{header}\n\n{table(rounds, figures(sizes, loads), bool(baseline))}"
    end = (f"Total {(time.perf_counter() - started) / 60:.1f} min; load average at the end "
           f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}.")
    print(f"{report}\n\nEvery figure (s: seconds from the call; MB: RSS):\n\n{every_figure(rounds, every)}\n\n{end}")
    if args.write_docs:  # the table; every figure stays in the run's output
        write_docs(f"{report}\n\n{end}", "launch")
    failed = [key for r in rounds for key, got in r.items() if "error" in got]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
