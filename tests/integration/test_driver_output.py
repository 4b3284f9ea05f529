"""What a plain script or spark-submit job shows with no logging set up and Spark's own
log configuration (not this project's conf/): progress and metrics, and a failed fit that
fits a screen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark
SCRIPT = Path(__file__).parent / "scripts" / "plain_fit.py"


def _run(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONF_DIR"}  # Spark's default log4j profile
    return subprocess.run([sys.executable, str(SCRIPT), mode], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow  # a script with a session of its own: about 18 s
def test_progress_and_epoch_metrics_reach_stderr_unless_show_progress_is_off():
    done = _run("show")
    assert done.returncode == 0, done.stderr[-3000:]
    shown, quiet = done.stderr.split("--- quiet ---\n")
    lines = [line for line in shown.splitlines() if "spark_torch_est: " in line]
    assert lines[0] == "spark_torch_est: checking the DataFrame, the Params and the model ...", shown
    assert any(line.startswith("spark_torch_est: launching 2 ranks (a Spark barrier job)") for line in lines), shown
    assert any(line.startswith("spark_torch_est: first step after ") and "; step 1/" in line
               and " of this fit, epoch 1" in line for line in lines), shown
    assert [line.split("spark_torch_est: ")[1][:len("epoch 1: train_loss=")] for line in lines
            if "train_loss=" in line] == ["epoch 1: train_loss=", "epoch 2: train_loss="], shown
    assert "spark_torch_est" not in quiet, quiet


@pytest.mark.slow  # a script with a session of its own: about 18 s
def test_a_failed_fit_prints_one_clear_error_on_a_screen_without_the_sealed_report():
    done = _run("fail")
    output = done.stdout + done.stderr
    assert done.returncode == 1
    assert "<<spark_torch_est-failure" not in output and "Exception in task" not in output, output[-5000:]
    assert output.count("spark_torch_est.errors.TrainingFailedError: hook 'Boom' raised: ValueError: boom in the "
                        "hook") == 1, output[-5000:]
    assert 'in after_train_iter\nValueError: boom in the hook' in output  # the user's frame
    assert len(output.splitlines()) <= 60, output


@pytest.mark.slow  # two ranks compile the model in a session of its own: about a minute
def test_a_compiled_fit_prints_no_profiler_notice_from_each_rank():
    """torch's "Profiler (record) function ... will be ignored" (DDP's record_function spans
    left out of the graph) came once per rank per fit."""
    done = _run("compiled")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "will be ignored" not in done.stderr, done.stderr[-3000:]
