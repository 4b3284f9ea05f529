"""Separate executor JVMs (local-cluster) and a real standalone cluster with spark-submit."""

from __future__ import annotations

import json
import math
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
    line = next((text for text in result.stdout.splitlines() if text.startswith("RESULT ")), None)
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
    # an executor JVM killed mid-epoch: relaunched from the newest checkpoint, same weights; with
    # minWorkers=1 the executor comes back within slotWaitTimeout, so no shrink
    assert found["killed"] and found["recovered_equal"] and found["recovered_epochs"] == [1, 2, 3, 4]
    assert found["recovered_sizes"] == [2, 2, 2, 2]
    # a rank killed in two launches in a row: two relaunches on both ranks, same weights
    assert found["crashes"] == 2 and found["twice_equal"] and found["twice_sizes"] == [2, 2, 2, 2]
    # kept rows across two executor JVMs: the 2nd and 3rd fits take them, bitwise as read again
    assert found["kept_reused"] == 2 and found["kept_missing"] == 0 and found["kept_equal"], found
    # more ranks than slots: refused with both numbers before any Spark job
    assert "numWorkers=3 needs 3 task slots at once, but the cluster offers 2" in found["refused"]["numWorkers"]
    assert "numWorkers=4 minWorkers=3 needs 3 task slots at once, but the cluster offers 2" in \
        found["refused"]["minWorkers"]
    assert found["refused_jobs"] == 0, found["refused"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Standalone:
    """A master on 127.0.0.1 from the installed pyspark, and the workers started with
    :meth:`start_worker`; :meth:`stop` stops them all by PID.

    Args:
        directory: Where logs and the workers' directories go.
        worker_timeout_s: Seconds before the master takes a silent worker for lost.
    """

    def __init__(self, directory: Path, worker_timeout_s: int = 60) -> None:
        import pyspark

        self.spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
        self.directory = directory
        self.port = _free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.env = dict(os.environ, SPARK_LOG_DIR=str(directory / "logs"),
                        SPARK_MASTER_OPTS=f"-Dspark.worker.timeout={worker_timeout_s}")
        self.log = open(directory / "cluster.log", "w")
        self.processes = [subprocess.Popen(
            [str(self.spark_class), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(self.port), "--webui-port", str(_free_port())],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env)]

    def start_worker(self, cores: int, own_group: bool = False) -> subprocess.Popen:
        """Starts a worker of ``cores`` cores (its JVM is the returned process); with
        ``own_group`` it leads a process group of its own (its executors and their Python
        processes in it), so SIGKILL of the group takes the whole worker."""
        worker = subprocess.Popen(
            [str(self.spark_class), "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
             "--cores", str(cores), "--memory", "4g", "--work-dir", str(self.directory / "work"),
             "--webui-port", str(_free_port()), self.url],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=own_group)
        self.processes.append(worker)
        return worker

    def stop(self) -> None:
        """Stops the workers, then the master (those already dead are only reaped)."""
        running = [p for p in reversed(self.processes) if p.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        for process in running:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.log.close()


@pytest.fixture
def standalone(tmp_path):
    """A master and a two-core worker on 127.0.0.1, stopped by PID."""
    cluster = _Standalone(tmp_path)
    cluster.start_worker(cores=2)
    try:
        yield cluster.url, tmp_path
    finally:
        cluster.stop()


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


def _script_result(stdout: str, stderr: str) -> dict:
    """The ``RESULT {json}`` line a script printed (else the test fails with its output)."""
    line = next((text for text in stdout.splitlines() if text.startswith("RESULT ")), None)
    assert line, stdout[-2000:] + stderr[-6000:]
    return json.loads(line[len("RESULT "):])


def _every_row_once(directory: Path, labels, epochs: dict[int, int]) -> None:
    """Every epoch in ``epochs`` trained every row once, all on ``epochs[epoch]`` ranks."""
    import numpy as np

    from tests.helpers import recorded_rows

    found = recorded_rows(str(directory))
    assert {epoch: list(worlds) for epoch, worlds in found.items()} == {e: [w] for e, w in epochs.items()}
    for epoch, world in epochs.items():
        assert np.array_equal(found[epoch][world]["labels"], np.sort(labels)), epoch


def test_local_one_slot_trains_num_workers_two_on_one_rank_with_the_global_batch(tmp_path):
    import numpy as np

    result = subprocess.run([sys.executable, str(SCRIPTS / "elastic_fit.py"), "local", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    found = _script_result(result.stdout, result.stderr)
    elastic = found["elastic"]
    # batchSize=32, numWorkers=2: one rank of 64 rows per step, the steps of two ranks (2000 rows)
    assert [e["world_size"] for e in elastic["history"]] == [1, 1, 1]
    assert elastic["global_step"] == 3 * math.ceil(2000 / 64)
    assert elastic["weight_error"] < 0.05
    _every_row_once(tmp_path / "rows", np.load(tmp_path / "labels.npy"), {1: 1, 2: 1, 3: 1})
    batches = np.load(tmp_path / "rows" / "e1-w1-r0.npz")["batches"]
    assert set(batches[:-1].tolist()) == {64} and batches[-1] == 2000 - 31 * 64
    # without minWorkers, as before: the numbers and the fix
    assert "numWorkers=2 needs 2 task slots at once, but the cluster offers 1" in found["error"]
    assert "local mode cannot add slots" in found["error"]


@pytest.mark.timeout(900)
def test_a_lost_standalone_worker_shrinks_the_run_which_grows_back_when_it_returns(tmp_path):
    """numWorkers=2, minWorkers=1, maxRetries=2 on two one-core workers; a hook SIGKILLs
    rank 1's whole worker mid-epoch; the fit finishes on one rank; the worker is restarted
    and the next fit trains on two. Then the same kill without minWorkers fails, as today."""
    import numpy as np

    cluster = _Standalone(tmp_path, worker_timeout_s=30)
    workers = [cluster.start_worker(cores=1) for _ in range(2)]
    log = tmp_path / "script.log"
    with open(log, "w") as out:
        script = subprocess.Popen([sys.executable, str(SCRIPTS / "elastic_fit.py"), "standalone", str(tmp_path),
                                   cluster.url], stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 540
        while not (tmp_path / "fit1-done").exists() and script.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # polling the script's progress
        if (tmp_path / "fit1-done").exists():
            assert len([w for w in workers if w.poll() is not None]) == 1, "the hook kills exactly one worker"
            cluster.start_worker(cores=1)
            (tmp_path / "restarted").touch()
        script.wait(max(deadline - time.monotonic(), 1))
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
        cluster.stop()
    output = (log.read_text(), "")
    found = _script_result(*output)
    undisturbed, elastic, grown = found["undisturbed"], found["elastic"], found["grown"]
    # killed in epoch 2, resumed from the end of epoch 1 on the one rank left
    assert [e["world_size"] for e in elastic["history"]] == [2, 1, 1, 1]
    assert elastic["global_step"] == undisturbed["global_step"] == 4 * math.ceil(2000 / 64)
    _every_row_once(tmp_path / "rows", np.load(tmp_path / "labels.npy"), {1: 2, 2: 1, 3: 1, 4: 1, 5: 2})
    for shrunk, whole in zip(elastic["history"], undisturbed["history"]):  # the losses of an undisturbed run
        assert abs(shrunk["train_loss"] - whole["train_loss"]) <= 0.2 * whole["train_loss"] + 1e-4, shrunk
    assert elastic["weight_error"] < 0.05
    # the worker restarted: the next fit trains on both ranks again
    assert [e["world_size"] for e in grown["history"]] == [2, 1, 1, 1, 2]
    # time from the kill to training again: the survivor's first step after the kill
    kill = found["kill"]["time"]
    resumed = [float(t) for t, world, _ in found["steps"] if int(world) == 1 and float(t) > kill]
    assert resumed, found["steps"]
    assert "numWorkers=2 needs 2 task slots at once, but the cluster offers 1" in found["today_error"]
    assert "numWorkers=2 needs 2 task slots at once, but the cluster offers 1" in found["first_fit_error"]
    assert found["first_fit_jobs"] == 0, "a first fit on too few slots is refused before any Spark job"
    print(f"kill -> training on the survivor: {resumed[0] - kill:.1f}s; kill -> error without minWorkers: "
          f"{found['today_seconds']:.1f}s (slotWaitTimeout=10)")


@pytest.mark.timeout(900)
def test_a_lightning_module_whose_worker_is_lost_goes_on_on_the_rank_left(tmp_path):
    """A LightningModule, numWorkers=2, minWorkers=1 on two one-core workers; a callback
    SIGKILLs rank 1's whole worker mid-epoch 2: Lightning's run goes on on one rank from the
    epoch-1 checkpoint, every row once per epoch, with the steps and about the losses of an
    undisturbed fit."""
    import numpy as np

    pytest.importorskip("lightning.pytorch")
    cluster = _Standalone(tmp_path, worker_timeout_s=30)
    for _ in range(2):
        cluster.start_worker(cores=1)
    try:
        done = subprocess.run([sys.executable, str(SCRIPTS / "lightning_elastic_fit.py"), str(tmp_path), cluster.url],
                              capture_output=True, text=True, timeout=600)
    finally:
        cluster.stop()
    found = _script_result(done.stdout, done.stderr)
    undisturbed, elastic = found["undisturbed"], found["elastic"]
    assert [e["world_size"] for e in elastic["history"]] == [2, 1, 1, 1]
    assert elastic["global_step"] == undisturbed["global_step"] == 4 * math.ceil(2000 / 64)
    assert elastic["lightning_step"] == undisturbed["lightning_step"] == elastic["global_step"]
    _every_row_once(tmp_path / "rows", np.load(tmp_path / "labels.npy"), {1: 2, 2: 1, 3: 1, 4: 1})
    for shrunk, whole in zip(elastic["history"], undisturbed["history"]):
        assert abs(shrunk["train_loss"] - whole["train_loss"]) <= 0.2 * whole["train_loss"] + 1e-4, shrunk
        assert abs(shrunk["mse"] - shrunk["train_loss"]) <= 1e-3 * whole["train_loss"] + 1e-5, shrunk
    assert elastic["weight_error"] < 0.05


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_three_whole_worker_kills_in_one_fit_train_every_row_once_per_epoch_and_grow_back(tmp_path):
    """numWorkers=2, minWorkers=1, a checkpoint every 10 steps, two one-core workers; rank
    1's whole worker is SIGKILLed (its process group) three times during one fit, each time
    restarted 25 s later. Every global step trains the rows of an undisturbed run, every row
    once per epoch; the run shrinks to one rank and grows back to two each time."""
    cluster = _Standalone(tmp_path, worker_timeout_s=30)
    for _ in range(2):
        cluster.start_worker(cores=1, own_group=True)
    log = tmp_path / "script.log"
    with open(log, "w") as out:
        script = subprocess.Popen([sys.executable, str(SCRIPTS / "killed_fit.py"), str(tmp_path), cluster.url],
                                  stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, restarted = time.monotonic() + 1000, 0
        while script.poll() is None and time.monotonic() < deadline:
            marker = tmp_path / f"killed-{restarted}.json"
            if marker.exists() and time.time() >= json.loads(marker.read_text())["time"] + 25:
                cluster.start_worker(cores=1, own_group=True)
                (tmp_path / f"restarted-{restarted}").touch()
                restarted += 1
            time.sleep(0.5)  # polling the script's progress
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
        cluster.stop()
    text = log.read_text()
    found = _script_result(text, "")
    undisturbed, elastic = found["undisturbed"], found["elastic"]
    assert len(found["kills"]) == 3 and restarted == 3, found["kills"]
    assert (elastic["epoch"], elastic["global_step"], elastic["samples"]) == \
        (undisturbed["epoch"], undisturbed["global_step"], undisturbed["samples"]) == (8, 8 * 47, 8 * 3000)
    assert elastic["steps"] == undisturbed["steps"], "each global step trains the rows it trains undisturbed"
    for epoch in range(8):
        seen = sorted(v for step in range(47 * epoch + 1, 47 * epoch + 48) for v in elastic["steps"][str(step)])
        assert seen == list(range(3000)), f"epoch {epoch + 1}: every row exactly once"
    for changed, whole in zip(elastic["history"], undisturbed["history"]):
        assert changed["train_loss"] == pytest.approx(whole["train_loss"], rel=0.05), changed
    assert {e["world_size"] for e in elastic["history"]} <= {1, 2}
    assert found["scored"] == 3000 and found["scored_null"] == 0, "the fitted model scores every row"
    grown = [line for line in text.splitlines() if "growing the run from 1 to numWorkers=2 ranks" in line]
    assert len(grown) == 3, text[-6000:]
