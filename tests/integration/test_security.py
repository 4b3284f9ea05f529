"""Real attacks on real fits: an outsider who reaches the driver's rendezvous store can
impersonate a rank or forge failure reports, and can at worst cost a relaunch."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from pyspark.sql import functions as F
from pyspark.sql import types as T

from spark_torch_est import Hook
from spark_torch_est.errors import TrainingFailedError
from tests.helpers import estimator, listening_ports

pytestmark = pytest.mark.spark


class StoreSpy(threading.Thread):
    """An outsider on the driver's host: finds the fit's rendezvous store among the ports
    the driver opens, and the job's key prefix in it (``TCPStore.list_keys``)."""

    def __init__(self, on_job) -> None:
        super().__init__(name="attacker", daemon=True)
        self.on_job = on_job
        self.known = listening_ports(os.getpid())
        self.done = threading.Event()
        self.jobs: list[str] = []

    def run(self) -> None:
        stores: dict[int, object] = {}
        while not self.done.is_set():
            for port in listening_ports(os.getpid()) - self.known:  # each probed in its own thread
                self.known.add(port)
                threading.Thread(target=self._probe, args=(port, stores), daemon=True).start()
            for port, store in list(stores.items()):
                try:
                    prefixes = {key.split("/")[0] for key in store.list_keys() if key.startswith("ste-")}
                except Exception:
                    continue
                for job in sorted(prefixes - set(self.jobs)):
                    self.jobs.append(job)
                    self.on_job(store, port, job)
            time.sleep(0.05)

    @staticmethod
    def _probe(port: int, stores: dict[int, object]) -> None:
        import torch.distributed as dist
        from datetime import timedelta

        try:
            if not _speaks_first(port):  # the driver's channel challenges whoever connects; the store waits
                stores[port] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
        except Exception:
            pass

    def __enter__(self) -> StoreSpy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join(10)


def _speaks_first(port: int) -> bool:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.settimeout(0.3)
        try:
            return bool(sock.recv(1))
        except OSError:
            return False


class CrashOnce(Hook):
    """Hard-exits rank 1's Python worker at its 3rd step, the first time only, once the
    attacker has written its forgery (``<marker>.forged``)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def after_train_iter(self, rank, global_step):
        if rank == 1 and global_step == 3 and not os.path.exists(self.marker):
            deadline = time.monotonic() + 20
            while not os.path.exists(self.marker + ".forged") and time.monotonic() < deadline:
                time.sleep(0.05)
            open(self.marker, "w").close()
            os._exit(3)


@pytest.mark.parametrize("forgery", ["plain", "sealed with a guess", "unexpected field"])
def test_a_forged_failure_report_neither_hides_a_crash_nor_shows_its_text(spark, linear_df, tmp_path, caplog,
                                                                          forgery):
    report = {"kind": "user", "message": "ATTACKER: give up", "rank": 1, "stage": "after_train_iter",
              "hook": None, "traceback": ""}
    if forgery == "unexpected field":
        report["evil"] = True
    body = json.dumps(report)
    value = (f"<<spark_torch_est-failure {'0' * 64} {body} spark_torch_est-failure>>"
             if forgery == "sealed with a guess" else body)

    def forge(store, port, job):
        store.set(f"{job}/failure/1", value)
        (tmp_path / "crashed.forged").touch()

    est = estimator(hooks=[CrashOnce(str(tmp_path / "crashed"))], maxEpochs=2, maxRetries=1)
    with caplog.at_level(logging.INFO, logger="spark_torch_est"), StoreSpy(forge) as spy:
        est.fit(linear_df)
    assert spy.jobs, "the attacker found the job in the store"
    assert (tmp_path / "crashed").exists() and est.progress.epoch == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any("relaunching training (1 of 1)" in m for m in messages), "the crash was relaunched"
    assert not any("ATTACKER" in m for m in messages)


def test_a_forged_report_cannot_turn_a_crash_into_another_error(spark, linear_df, tmp_path):
    def forge(store, port, job):
        store.set(f"{job}/failure/1", '{"kind": "user", "message": "x", "rank": 1, "stage": "s", "evil": 1}')
        (tmp_path / "crashed.forged").touch()

    est = estimator(hooks=[CrashOnce(str(tmp_path / "crashed"))], maxEpochs=2, maxRetries=0)
    with StoreSpy(forge), pytest.raises(TrainingFailedError) as error:
        est.fit(linear_df)
    assert error.value.retryable and est.checkpoint is None


IMPOSTOR = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from spark_torch_est.rendezvous import authenticate_peers

    class Payload:
        def __reduce__(self):
            return (open, (sys.argv[1], "w"))

    port, job = sys.stdin.readline().split()
    store = dist.PrefixStore(job, dist.TCPStore("127.0.0.1", int(port), is_master=False))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=20))
    print("joined", flush=True)
    try:
        authenticate_peers(b"a guess" * 5, 1, 2, torch.device("cpu"))  # what a rank does, without the secret
    except Exception:
        pass                                                              # an attacker carries on regardless
    try:
        dist.all_gather_object([None, None], Payload())                  # the pickle payload
    except Exception as error:
        print("refused:", type(error).__name__, flush=True)
""")


def test_an_impersonating_rank_is_refused_and_costs_at_most_a_relaunch(spark, linear_data, tmp_path, caplog):
    x, y, _, _ = linear_data
    slow_once = str(tmp_path / "slowed")

    @F.udf(T.DoubleType())
    def late_on_rank_1(label):  # the real rank 1 reaches the rendezvous late, the first time only
        from pyspark import TaskContext

        if TaskContext.get().partitionId() == 1 and not os.path.exists(slow_once):
            time.sleep(10)
            open(slow_once, "w").close()
        return label

    rows = [(row.tolist(), float(t)) for row, t in zip(x, y)]
    df = spark.createDataFrame(rows, ["features", "label"]).withColumn("label", late_on_rank_1("label"))
    payload_marker = tmp_path / "payload-ran"
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, str(payload_marker)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

    def impersonate(store, port, job):
        if impostor.stdin is not None and not impostor.stdin.closed:
            impostor.stdin.write(f"{port} {job}\n")
            impostor.stdin.close()

    clean = estimator(maxEpochs=2, seed=4)
    clean.fit(spark.createDataFrame(rows, ["features", "label"]))
    est = estimator(maxEpochs=2, seed=4, maxRetries=1, timeout=60.0)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch_est"), StoreSpy(impersonate):
            est.fit(df)
        impostor.wait(timeout=60)
        output = impostor.stdout.read()
    finally:
        impostor.kill()
        impostor.stdout.close()
    assert "joined" in output and "refused" in output, output
    assert not payload_marker.exists(), "nothing the impostor sent was unpickled"  # no rank gathers objects at all
    # (tests/unit/test_package.py checks the sources); what this test shows is the refusal below
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "could not prove they hold this job's secret" in messages and "relaunching training (1 of 1)" in messages
    assert est.progress.epoch == 2
    for key, value in clean.checkpoint.model_state.items():
        assert torch.equal(value, est.checkpoint.model_state[key]), key


class _Padded(torch.nn.Module):
    """A linear model carrying 1.2 MB of buffer: a resumed fit's task function passes 1 MB."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)
        self.register_buffer("pad", torch.zeros(300_000))

    def forward(self, x):
        return self.linear(x)


def test_no_job_secret_stays_in_files_after_the_fits(spark, linear_df):
    """PySpark writes a task function past 1 MB (it carries the job's secret) to its temp
    dir for the whole session; the spec travels as a broadcast that is removed after the job."""
    temp_dir = spark.sparkContext._temp_dir
    before = set(os.listdir(temp_dir))
    est = estimator(model=lambda c: _Padded(), scheduler=None, maxEpochs=3)
    for _ in range(3):
        est.fit(linear_df, duration="1ep")  # the second and third resume from a 1.2 MB checkpoint
    left = sorted(set(os.listdir(temp_dir)) - before)
    assert est.progress.epoch == 3 and left == []
