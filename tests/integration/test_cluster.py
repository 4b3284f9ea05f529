"""Separate executor JVMs (local-cluster) and a real standalone cluster with spark-submit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.cluster, pytest.mark.slow]
ROOT = Path(__file__).parents[2]
SCRIPTS = Path(__file__).parent / "scripts"


def _gpu_discovery_script(directory: Path) -> Path:
    script = directory / "gpus.sh"
    script.write_text('#!/usr/bin/env bash\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    script.chmod(0o755)
    return script


def test_local_cluster_two_executors_fake_gpus_and_a_killed_executor(tmp_path):
    env = dict(os.environ, SPARK_WORKER_DIR=str(tmp_path / "work"))
    result = subprocess.run([sys.executable, str(SCRIPTS / "cluster_fit.py"), str(tmp_path),
                             str(_gpu_discovery_script(tmp_path))],
                            capture_output=True, text=True, timeout=600, env=env)
    line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, result.stdout[-2000:] + result.stderr[-4000:]
    found = json.loads(line[len("RESULT "):])
    assert found["weight_error"] < 0.05 and found["rmse"] < 0.05 and found["epochs"] == 4
    ranks = found["ranks"]
    assert ranks[0]["jvm"] != ranks[1]["jvm"], "both ranks ran in one executor"
    assert all(len(r["gpus"]) == 1 and r["device"] == "cpu" for r in ranks)  # no CUDA build: CPU
    visible = found["visible"].split(",")  # the executors' CUDA_VISIBLE_DEVICES
    for task in ranks + found["scoring"]:  # the fit's ranks and transform's tasks alike
        gpus = task["gpus"] if isinstance(task["gpus"], list) else task["gpus"].split(",")
        assert len(gpus) == 1 and task["index"] == int(gpus[0]) and task["physical"] == visible[int(gpus[0])], task
    assert len(found["scoring"]) == 3  # one per partition
    assert found["on_cpu"] and "running on the CPU" in found["on_cpu"][0]  # the fit said so
    assert "useGpu=True" in found["gpu_error"] and "Spark assigned GPUs" in found["gpu_error"]
    # an executor JVM killed mid-epoch: relaunched from the newest checkpoint, same weights
    assert found["killed"] and found["recovered_equal"] and found["recovered_epochs"] == [1, 2, 3, 4]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def standalone(tmp_path):
    """A master and a worker on 127.0.0.1 from the installed pyspark, stopped by PID."""
    import pyspark

    spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
    port = _free_port()
    env = dict(os.environ, SPARK_LOG_DIR=str(tmp_path / "logs"))
    log = open(tmp_path / "cluster.log", "w")
    master = subprocess.Popen([str(spark_class), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(_free_port())],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    worker = subprocess.Popen([str(spark_class), "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                               "--cores", "2", "--memory", "4g", "--work-dir", str(tmp_path / "work"),
                               "--webui-port", str(_free_port()), f"spark://127.0.0.1:{port}"],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield f"spark://127.0.0.1:{port}", tmp_path
    finally:
        for process in (worker, master):
            process.send_signal(signal.SIGTERM)
        for process in (worker, master):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


def test_spark_submit_the_example_to_a_standalone_cluster(standalone):
    master, tmp_path = standalone
    package = tmp_path / "spark_torch_est.zip"
    with zipfile.ZipFile(package, "w") as archive:
        for path in (ROOT / "spark_torch_est").glob("*.py"):
            archive.write(path, f"spark_torch_est/{path.name}")
    submit = Path(sys.executable).parent / "spark-submit"
    started = time.monotonic()
    # submitted at once: the fit must wait for the worker's executors to register
    result = subprocess.run(
        [str(submit), "--master", master, "--py-files", str(package), "--conf", "spark.executor.cores=1",
         "--conf", "spark.cores.max=2", "--conf", "spark.executor.memory=1g", "--conf", "spark.ui.enabled=false",
         str(ROOT / "examples" / "train_regression.py")],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, TMPDIR=str(tmp_path)),  # its MLflow store
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "after the second fit: Progress(epoch=6" in result.stdout, output[-4000:]
    assert "both fits were logged as one MLflow run" in result.stdout, output[-4000:]
    rmse = float(result.stdout.split("test RMSE ")[1].split()[0])
    baseline = float(result.stdout.split("predicting the mean: ")[1].split(")")[0])
    assert rmse < baseline / 2
    shipped = list((tmp_path / "work").glob("app-*/*/spark_torch_est.zip"))
    assert shipped, "the package zip did not reach the executors"
    print(f"spark-submit to standalone: {time.monotonic() - started:.0f}s")
