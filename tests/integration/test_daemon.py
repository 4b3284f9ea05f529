"""``spark.python.daemon.module=spark_torch_est.daemon``: Python workers forked with torch
imported, in a session of their own (the setting is read when the session starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark
SCRIPT = Path(__file__).parent / "scripts" / "preloaded_fit.py"


@pytest.mark.compat
@pytest.mark.slow  # a session of its own whose workers the daemon forks: about 21 s
def test_workers_forked_from_the_package_daemon_have_torch_from_their_first_task_and_train_and_score():
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["preloaded"] == [[True, True]] * 2, "the first job's workers had torch and torch._dynamo before " \
        "their task ran"
    losses = result["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0] / 2, losses
    assert result["scored"] == 256 and result["evaluated"] == pytest.approx(result["mse"], rel=1e-4)
