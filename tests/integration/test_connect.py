"""Spark Connect: the same estimator from a Connect client (no SparkContext on the client,
so rendezvous falls back to one allGather and the live channel is off)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]
SCRIPTS = Path(__file__).parent / "scripts"


def test_fit_and_transform_from_a_spark_connect_session():
    pytest.importorskip("grpc", reason="pyspark[connect] extras are not installed")
    result = subprocess.run([sys.executable, str(SCRIPTS / "connect_fit.py")], capture_output=True, text=True,
                            timeout=600, env=dict(os.environ))
    line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, result.stdout[-2000:] + result.stderr[-4000:]
    found = json.loads(line[len("RESULT "):])
    assert found["session"].startswith("pyspark.sql.connect")
    assert found["epochs"] == 4 and found["weight_error"] < 0.05 and found["rmse"] < 0.05
