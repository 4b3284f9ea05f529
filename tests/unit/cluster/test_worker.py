"""The barrier task's entry: the part read beside the rendezvous and the teardown that cannot hang."""

from __future__ import annotations

import pytest


class _Held:
    """Stands in for a DDP model: weakly referenceable, owned by whatever holds it."""


@pytest.fixture
def lone_process_group():
    """A real one-rank gloo group for ``_teardown`` to destroy; undone if a test fails."""
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    gc.unfreeze()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_teardown_frees_a_model_that_only_old_garbage_still_reaches(lone_process_group, caplog):
    import gc
    import weakref

    import torch.distributed as dist

    from spark_torch_est.cluster import worker

    old = _Held()
    old.cycle = old  # cyclic garbage-to-be that predates training: frozen below
    gc.freeze()
    model = _Held()
    old.model = model  # training hands the old object a reference, then both are dropped
    ref = weakref.ref(model)
    del old, model
    gc.collect()
    assert ref() is not None, "a frozen object keeps it out of the quick collection"
    kept = len(worker._KEPT_ALIVE)
    worker._teardown(clean=True, ddp=[ref])
    assert ref() is None, "freed before the process group, after the full collection"
    assert not dist.is_initialized() and len(worker._KEPT_ALIVE) == kept
    assert "still referenced" not in caplog.text


def test_teardown_keeps_a_model_a_global_still_holds_instead_of_freeing_it_later(lone_process_group, caplog):
    import weakref

    import torch.distributed as dist

    from spark_torch_est.cluster import worker

    holder = [_Held()]  # a hook's global, say
    ref = weakref.ref(holder[0])
    worker._teardown(clean=True, ddp=[ref])
    holder.clear()
    assert ref() is not None and ref() in worker._KEPT_ALIVE
    assert not dist.is_initialized() and "still referenced after training" in caplog.text
    worker._KEPT_ALIVE.remove(ref())


def test_a_worker_reuses_the_table_part_it_read_until_the_files_change(tmp_path):
    import os

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_torch_est.cluster import worker
    from spark_torch_est.core.protocol import FEATURES, LABEL
    from spark_torch_est.core.spec import FilePart, FileSource, How
    from spark_torch_est.ingest import held
    from tests.helpers import features_schema, task_spec

    path = str(tmp_path / "t.parquet")
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    pq.write_table(pa.table({"f": pa.array(list(x), pa.list_(pa.float32())), "y": np.arange(20.0)}), path)
    source = FileSource(outputs=((FEATURES, ("f",), How.AS_IS), (LABEL, ("y",), How.AS_IS)),
                        parts=((FilePart(path, 0, 0, 20),),), digest="d")
    spec = task_spec(schema=features_schema(2), source=source)
    first = worker._ingest(spec, iter([]), 0)
    assert worker._ingest(spec, iter([]), 0) is first, "the same part of the same files: read once"
    assert worker._ingest(task_spec(schema=features_schema(2), source=source, memory_budget=1), iter([]), 0) \
        is not first, "another budget: read again"
    pq.write_table(pa.table({"f": pa.array(list(x * 2), pa.list_(pa.float32())), "y": np.arange(20.0)}), path)
    os.utime(path, ns=(10**18, 10**18))
    changed = worker._ingest(spec, iter([]), 0)
    assert changed is not first and float(changed.train.inputs[0].tensor[1, 0]) == 4.0, "changed files: read again"
    held.forget()


def test_a_rank_reads_its_part_of_the_files_beside_the_rendezvous_and_logs_where_the_launch_went(tmp_path, caplog):
    import logging
    import threading

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_torch_est.cluster import worker
    from spark_torch_est.cluster.barrier import LocalBarrier
    from spark_torch_est.core.protocol import FEATURES, LABEL
    from spark_torch_est.core.spec import FilePart, FileSource, How
    from spark_torch_est.ingest import held
    from tests.helpers import LOCAL_LAUNCH, features_schema, task_spec

    path = str(tmp_path / "t.parquet")
    x = np.arange(320, dtype=np.float32).reshape(40, 8) / 320
    pq.write_table(pa.table({"f": pa.array(list(x), pa.list_(pa.float32())), "y": np.arange(40.0)}), path)
    source = FileSource(outputs=((FEATURES, ("f",), How.AS_IS), (LABEL, ("y",), How.AS_IS)),
                        parts=((FilePart(path, 0, 0, 40),),), digest="beside")
    readers = []
    read_part = worker.read_part

    def recorded(*args):  # the real read, noting the thread it runs on
        readers.append(threading.current_thread().name)
        return read_part(*args)

    held.forget()
    worker.read_part = recorded
    try:
        with caplog.at_level(logging.DEBUG, logger="spark_torch_est.train.loop"):
            worker.run_rank(task_spec(schema=features_schema(8), source=source), LOCAL_LAUNCH, iter([]),
                            LocalBarrier())
    finally:
        worker.read_part = read_part
        held.forget()
    assert readers == ["spark_torch_est-ingest"], "the part is read on a thread of its own, beside the rendezvous"
    (line,) = [r.getMessage() for r in caplog.records if "the launch took" in r.getMessage()]
    assert all(f"{phase} " in line for phase in ("rendezvous", "ingest", "layout", "setup", "first step")), line


def test_rows_that_stop_coming_from_spark_are_spark_s_failure_and_never_outrank_the_cause():
    """A rank whose input Spark cut off (the stage aborted as another rank failed) reports a
    system failure: the cause reported beside it decides, and the job is relaunched."""
    import pyarrow as pa

    from spark_torch_est.cluster.failure import (
        SYSTEM,
        PeerAuthenticationError,
        SparkInputLost,
        describe,
        explain_job_failure,
    )
    from spark_torch_est.cluster.worker import _from_spark

    def broken():
        yield pa.RecordBatch.from_arrays([pa.nulls(1)], ["x"])
        raise pa.ArrowInvalid("Tried reading schema message, was null or length 0")

    batches = _from_spark(broken())
    assert next(batches).num_rows == 1
    with pytest.raises(SparkInputLost, match="Spark stopped sending this task's rows") as lost:
        next(batches)
    cut_off = describe(lost.value, 1, "ingest", None)
    assert cut_off.kind == SYSTEM
    impostor = describe(PeerAuthenticationError("rank(s) [1] could not prove it"), 0, "rendezvous", None)
    error = explain_job_failure("Job aborted due to stage failure", [cut_off, impostor], b"s" * 32)
    assert "PeerAuthenticationError" in str(error) and error.retryable
