"""Ctrl-C and large checkpoints, each in a driver process of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spark_torch_est import TorchEstimator
from tests.helpers import descendants

pytestmark = pytest.mark.spark
SCRIPTS = Path(__file__).parent / "scripts"


def _start(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPTS / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ))


@pytest.mark.slow  # a job in a process of its own, interrupted: about 30 s
def test_ctrl_c_cancels_the_fit_keeps_the_run_and_leaves_nothing_behind(tmp_path):
    marker = tmp_path / "training"
    process = _start("interrupted_fit.py", str(marker))
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the second fit never started training"
            time.sleep(0.2)
        spawned = descendants(process.pid)
        interrupted = time.monotonic()
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
    lines = [line for line in output.splitlines() if line.split(" ")[0] in ("FIRST", "INTERRUPTED", "RESUMED")]
    assert lines[1:] == ["INTERRUPTED True True", "RESUMED 2"], output[-3000:]
    assert process.returncode == 0
    assert time.monotonic() - interrupted < 120
    deadline = time.monotonic() + 20
    while _alive(spawned) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(spawned), "processes of the driver outlived it"


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(pid)
        except OSError:
            pass
    return alive


def _outcome(*args: str) -> str:
    output, _ = _start("result_too_large.py", *args).communicate(timeout=300)
    return next((text for text in output.splitlines() if text.startswith(("ERROR", "NO ERROR"))), output[-2000:])


@pytest.mark.slow  # a session of its own: about 19 s
def test_a_checkpoint_over_max_result_size_comes_back_over_the_channel():
    line = _outcome()
    assert line.startswith("NO ERROR") and int(line.split()[2]) > 1 << 20, line


@pytest.mark.slow  # a session of its own: about 19 s
def test_a_checkpoint_over_max_result_size_as_result_rows_names_the_setting():
    line = _outcome("rows")
    assert line.startswith("ERROR") and "spark.driver.maxResultSize" in line, line


class _Huge(torch.nn.Module):
    """A linear model carrying a frozen 200 MB parameter."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)
        self.table = torch.nn.Parameter(torch.arange(50_000_000, dtype=torch.float32), requires_grad=False)

    def forward(self, x):
        return self.linear(x)


@pytest.mark.slow
def test_a_200_mb_model_comes_back_to_the_driver(spark, linear_df):
    est = TorchEstimator(model=lambda c: _Huge(),
                         optimizer=lambda m, c: torch.optim.SGD(m.linear.parameters(), lr=0.05),
                         loss=torch.nn.MSELoss(), maxEpochs=1, numWorkers=2, batchSize=256, showProgress=False)
    started = time.monotonic()
    model = est.fit(linear_df)
    elapsed = time.monotonic() - started
    table = est.checkpoint.model_state["table"]
    assert table.numel() * 4 >= 200_000_000
    assert torch.equal(table, torch.arange(50_000_000, dtype=torch.float32))
    assert model.torch_model().table.shape == table.shape
    print(f"200 MB fit + return: {elapsed:.1f}s")
