"""The benchmarks stay runnable: they use only the public API, their pieces work without
Spark, and they measure the checkout that BENCH_PACKAGE names (the Spark runs are in
tests/integration/test_benchmarks.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch

import spark_torch_est
from benchmarks import launch
from benchmarks.__main__ import comparisons
from benchmarks.common import Workload, make_model, plain_train, read_rank, write_data

ROOT = Path(__file__).parents[2]
PUBLIC = {"spark_torch_est": set(spark_torch_est.__all__),
          "spark_torch_est.tuning": {"SuccessiveHalving", "SuccessiveHalvingModel"}}


def test_benchmarks_import_only_the_public_api():
    for source in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spark_torch_est"):
                names = {alias.name for alias in node.names}
                assert names <= PUBLIC.get(node.module, set()), f"{source.name} imports {node.module}: {names}"
            elif isinstance(node, ast.Import):
                assert all(a.name == "spark_torch_est" or not a.name.startswith("spark_torch_est")
                           for a in node.names), source.name


def test_the_peers_loop_trains_both_workloads(tmp_path):
    for workload in (Workload(rows=512, epochs=1), Workload(kind="rec", rows=512, features=13, hidden=8, epochs=1)):
        workload = write_data(workload, str(tmp_path))
        inputs, labels = read_rank(workload, 1, 2)
        assert len(labels) == 256 and labels.shape == (256, 1)
        model, optimizer = workload.build()
        clock = plain_train(model, optimizer, inputs, labels, workload.loss_fn(), epochs=1, batch_size=64, seed=0)
        assert clock.steps == 4 and clock.figures(clock.first)["samples_per_s"] > 0
        if workload.kind == "rec":
            assert inputs[0].dtype == torch.int64 and inputs[0].min() > 2 ** 24 and inputs[2].shape == (256, 13)
        assert isinstance(make_model(workload.config), torch.nn.Module)


def test_ratios_are_paired_within_rounds_and_the_same_work_is_checked():
    rounds = [{"te": {"loss": 1.0, "warm_wall_s": 1.0}, "td_local": {"warm_wall_s": 4.0}, "ddp": {"loss": 1.0}},
              {"te": {"loss": 2.0, "warm_wall_s": 3.0}, "td_local": {"warm_wall_s": 6.0}, "ddp": {"loss": 1.0}}]
    table, missed = comparisons(rounds)
    assert "| fit wall time, warm | 2.00 [1.00-3.00] |" in table and "0.375x [0.250-0.500]" in table
    assert missed == ["final loss, 20k rows (the same work)"]  # 1.5x the bare DDP's loss in the median


def test_launch_table_pairs_the_baseline_within_rounds_and_reads_pyarrow_once():
    loads = launch.workloads(launch.QUICK_SIZES, quick=True)
    rounds = [{"pyarrow": {"read_s": read}, "files": {"warm_first_step_s": 2.0},
               "then_files": {"warm_first_step_s": then}} for read, then in ((1.0, 4.0), (2.0, 2.0))]
    text = launch.table(rounds, launch.figures(launch.QUICK_SIZES, loads), baseline=True)
    assert "| 1.50x [1.00-2.00] | 2.50x [1.00-4.00] | 0.750x [0.500-1.000] | <=1x | NO |" in text
    assert "16 ranks" not in text  # a row without figures (its contender not run) is left out


def test_bench_package_selects_the_measured_checkout(tmp_path):
    package = tmp_path / "spark_torch_est"
    package.mkdir()
    (package / "__init__.py").write_text("")
    env = {**os.environ, "BENCH_PACKAGE": str(tmp_path)}
    code = ("import benchmarks, os, spark_torch_est; "
            "print(spark_torch_est.__file__, os.getcwd(), os.environ['PYTHONPATH'].split(os.pathsep)[0])")
    done = subprocess.run([sys.executable, "-c", code],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == [str(package / "__init__.py"), str(tmp_path), str(tmp_path)]

