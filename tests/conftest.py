"""Shared test setup: the executors' Python, loopback networking, and leak checks."""

from __future__ import annotations

import gc
import os
import sys
import threading

import pytest

# Executors must run this interpreter (it has torch), and everything binds to loopback.
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # compileModel: no compile pool (2 shared cores)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # tests reach no host outside this machine


@pytest.fixture(autouse=True)
def no_leaked_process_group():
    """A test must not leave a torch.distributed process group behind in this process."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a torch.distributed process group initialized")


@pytest.fixture(autouse=True)
def no_leaked_rank_processes():
    """A test must not leave a process it started running: Python joins them at exit, so a
    hung one would hang the whole run. Any still running 10 s after the test are killed."""
    import multiprocessing

    yield
    running = multiprocessing.active_children()
    for process in running:
        process.join(10)
    hung = [process.pid for process in running if process.is_alive()]
    for process in running:
        if process.is_alive():
            process.kill()
            process.join(5)
    assert not hung, f"processes still running after the test (killed): {hung}"


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """A test must not leave new non-daemon threads running (they would block exit)."""
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive() and not t.daemon]
    assert not leaked, f"threads leaked by the test: {leaked}"


@pytest.fixture(autouse=True)
def nothing_left_frozen():
    """A test that runs a task function in this process (a scoring task freezes the objects
    alive when it starts, as in a Python worker) leaves the collector as it found it."""
    yield
    gc.unfreeze()
