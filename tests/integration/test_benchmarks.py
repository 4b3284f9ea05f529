"""The benchmarks run end to end against this checkout (each in its own driver process),
so a change of the package cannot silently break them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark
ROOT = Path(__file__).parents[2]


def _run(*args: str, timeout: int) -> str:
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.mark.slow  # the benchmark's smoke run, in a process of its own: about 18 s
def test_hook_overhead_runs_fits_with_public_hooks():
    out = _run("benchmarks.hook_overhead", "--rows", "4096", "--epochs", "1", "--rounds", "1", timeout=300)
    assert "5 no-op hooks cost" in out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quick_suite_and_growth_table_run():
    out = _run("benchmarks", "--quick", timeout=1200)
    assert "| final loss, 20k rows (the same work) |" in out and "| ingest: second fit on df.cache() |" in out
    assert "n/a" not in out.split("Every figure")[0]
    out = _run("benchmarks.scale", "--quick", timeout=600)
    assert "| 200,000 |" in out


@pytest.mark.slow  # 8 fresh processes, two of 16 ranks: 4 minutes on 2 cores at load 5-10
@pytest.mark.timeout(1200)
def test_quick_launch_table_prints_every_row_with_a_figure():
    out = _run("benchmarks.launch", "--quick", timeout=1100)
    table = out.split("| Figure |", 1)[1].split("Every figure", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    starts = ["plain Parquet table", "largest rank's peak RSS", *["first fit through Spark"] * 2,
              *["peak above one share while the layout is built"] * 6, "16 ranks on local[16]",
              "same, the workers forked from spark_torch_est.daemon"]
    assert [row.split(" | ")[0][2:len(start) + 2] for row, start in zip(rows, starts)] == starts
    assert len(rows) == len(starts)
    assert all(re.fullmatch(r"-?[\d,.]+( MB| shares| s|x)", row.split(" | ")[1]) for row in rows), table


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_ingest_once_runs_and_a_cross_validators_folds_read_their_rows_once():
    out = _run("benchmarks.ingest_once", "--quick", "--only", "computed,cv", timeout=800)
    assert "| computed | on |" in out and "| computed | off |" in out
    kept_cv = next(line for line in out.splitlines() if "keeping on:" in line)
    assert "3 training jobs for 5 fits" in kept_cv, kept_cv  # a fold's two maps train in one job, then the refit


@pytest.mark.slow  # ten fits and a CrossValidator of 28: about two minutes on a loaded machine
@pytest.mark.timeout(900)
def test_fixed_cost_of_small_fits_and_crossvalidator_against_scikit_learn():
    out = _run("benchmarks.fixed_cost", "--fits", "1", timeout=800)
    assert "numWorkers=1: fit " in out and "numWorkers=2: fit " in out and "GridSearchCV on the same maps" in out
