"""Rows kept between fits on a rank's executor: written beside the ingest, read back the
same, bounded, dropped, and matched to ranks by what each task holds."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pyarrow as pa
import pytest
import torch

from spark_torch_est.core.spec import KeptPlan
from spark_torch_est.ingest import held, kept
from tests.helpers import features_batches, features_schema, task_spec


@pytest.fixture(autouse=True)
def local_dir(tmp_path, monkeypatch):
    """Spark's local directory of this "executor": a fresh one per test; nothing held after."""
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path / "blockmgr"))
    yield tmp_path / "blockmgr"
    held.forget()


class _Store:
    """The job's rendezvous store, as a dict (every task's offer is set before it is read)."""

    def __init__(self, offers: dict[int, bytes] | None = None) -> None:
        self.values = dict(offers or {})

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]


def _spec(mode: str, key: str = "k" * 32, limit: int = 1 << 30, world_size: int = 1, **fields):
    return task_spec(schema=features_schema(16), world_size=world_size,
                     kept=KeptPlan(key=key, mode=mode, limit=limit), **fields)


def _same(a, b) -> bool:
    return all(torch.equal(x.tensor, y.tensor) for x, y in zip(a.train.columns(), b.train.columns())) \
        and all(torch.equal(x.tensor, y.tensor) for x, y in zip(a.validation.columns(), b.validation.columns()))


def test_a_part_read_through_spark_is_kept_and_comes_back_the_same():
    written = kept.keep_while_reading(_spec("write"), features_batches(3000, validation_every=5), 0)
    assert os.path.getsize(kept.part_path("k" * 32, 0, 1)) > 3000 * 16 * 4
    held.forget()  # another fit in another worker: from the disk
    rank, read = kept.take_kept(_spec("read"), iter([]), _Store(), 0)
    assert rank == 0 and read is not written and _same(read, written)
    again = kept.take_kept(_spec("read"), iter([]), _Store(), 0)[1]
    assert again is read, "the same worker: from its memory"
    other = kept.take_kept(_spec("read", memory_budget=1), iter([]), _Store(), 0)[1]
    assert other is not read, "another memory budget: converted anew"


def test_an_abandoned_ingest_keeps_nothing():
    batches = kept._tee(features_batches(3000), KeptPlan("a" * 32, "write", 1 << 30), 0, 1)
    next(batches)
    batches.close()  # the rank failed while reading
    assert not os.path.exists(kept.part_path("a" * 32, 0, 1))
    assert os.listdir(os.path.dirname(kept.part_path("a" * 32, 0, 1))) == []


def test_what_a_rank_that_died_writing_a_part_left_goes_and_what_a_live_one_writes_stays():
    path = kept.part_path("a" * 32, 0, 1)
    os.makedirs(os.path.dirname(path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    writing = f"{path}.tmp-{os.getppid()}-1234"  # a live process (another fit's rank) writes it
    for name in (f"{path}.tmp-0123", f"{path}.tmp-{ended.pid}-5678", writing):  # ended before their finally ran
        with open(name, "wb") as left:
            left.write(b"x" * 1000)
    kept.keep_while_reading(_spec("write", key="a" * 32), features_batches(300), 0)
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path), os.path.basename(writing)]


def test_two_fits_writing_one_part_at_once_both_keep_it_without_warnings(caplog):
    plan = KeptPlan("a" * 32, "write", 1 << 30)
    first, second = (kept._tee(features_batches(3000, seed=0), plan, 0, 1) for _ in range(2))
    with caplog.at_level(logging.WARNING, logger="spark_torch_est.ingest.kept"):
        next(first)  # the first fit's rank is writing the part...
        next(second)  # ...when the second fit's rank starts writing it too
        for _ in first:
            pass
        for _ in second:
            pass
    assert "cannot keep this part's rows" not in caplog.text
    path = kept.part_path("a" * 32, 0, 1)
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    assert pa.ipc.open_file(path).read_all().num_rows == 3000, "the part is complete"


def test_past_the_bound_the_least_recently_used_rows_go_first():
    one_part = None
    for key in ("a" * 32, "b" * 32):
        kept.keep_while_reading(_spec("write", key=key), features_batches(2000), 0)
        one_part = os.path.getsize(kept.part_path(key, 0, 1))
        os.utime(os.path.dirname(kept.part_path(key, 0, 1)), (1, 1) if key[0] == "a" else None)
    kept.keep_while_reading(_spec("write", key="c" * 32, limit=2 * one_part + 1), features_batches(2000), 0)
    assert sorted(os.listdir(kept.kept_root())) == ["b" * 32, "c" * 32], "a, used longest ago, was evicted"
    kept.keep_while_reading(_spec("write", key="d" * 32, limit=one_part // 2), features_batches(2000), 0)
    assert os.listdir(kept.kept_root()) == [], "a part past the bound on its own is not kept either"


def test_dropped_keys_leave_disk_and_memory():
    spec = _spec("write")
    kept.keep_while_reading(spec, features_batches(500), 0)
    assert kept._offer(spec, spec.kept)["memory"] == [0]
    kept.drop(("j" * 32,))
    assert kept._offer(spec, spec.kept)["memory"] == [0], "another key's drop leaves these rows held"
    kept.drop(("k" * 32,))
    assert not os.path.exists(os.path.join(kept.kept_root(), "k" * 32))
    assert kept._offer(spec, spec.kept) == {"memory": [], "disk": []}


def test_tasks_take_the_ranks_of_the_parts_they_hold_memory_first():
    assert kept.assign([{"memory": [1], "disk": [0, 1]}, {"memory": [0], "disk": [0, 1]}], 2) == [1, 0]
    assert kept.assign([{"memory": [], "disk": [0, 1]}, {"memory": [], "disk": [0]}], 2) == [1, 0], \
        "a matching, not first come first served"
    assert kept.assign([{"memory": [], "disk": [0]}, {"memory": [], "disk": [0]}], 2) is None, "part 1 is gone"
    assert kept.assign([{"memory": [5, -1], "disk": [0]}], 1) == [0], "parts out of range are ignored"


def test_a_task_without_its_part_fails_the_job_for_the_driver_to_read_again():
    kept.keep_while_reading(_spec("write", world_size=2), features_batches(500), 0)
    store = _Store({"kept-offer/1": b"not json"})
    with pytest.raises(kept.KeptPartMissing, match=kept.MISSING):
        kept.take_kept(_spec("read", world_size=2), iter([]), store, 0)


def test_a_task_takes_the_rank_of_the_part_its_worker_holds():
    kept.keep_while_reading(_spec("write", world_size=2), features_batches(500, seed=1), 1)
    kept.keep_while_reading(_spec("write", world_size=2), features_batches(500, seed=0), 0)  # this worker holds 0
    store = _Store({"kept-offer/0": b'{"memory": [], "disk": [0, 1]}'})
    rank, ingested = kept.take_kept(_spec("read", world_size=2), iter([]), store, 1)
    assert rank == 0 and ingested is not None
