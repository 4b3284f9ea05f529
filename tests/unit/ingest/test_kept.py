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
    assert kept._size(kept.part_path("k" * 32, 0, 1)) > 3000 * 16 * 4
    held.forget()  # another fit in another worker: from the disk
    rank, read = kept.take_kept(_spec("read"), iter([]), _Store(), 0)
    assert rank == 0 and read is not written and _same(read, written)
    again = kept.take_kept(_spec("read"), iter([]), _Store(), 0)[1]
    assert again is read, "the same worker: from its memory"
    other = kept.take_kept(_spec("read", memory_budget=1), iter([]), _Store(), 0)[1]
    assert other is not read, "another memory budget: converted anew"


def _rows_of(part: str) -> int:
    return sum(pa.ipc.open_file(os.path.join(part, name)).read_all().num_rows for name in sorted(os.listdir(part)))


def test_an_abandoned_ingest_keeps_nothing():
    def failing():
        yield from features_batches(2000)
        raise OSError("the rank's input broke off")

    with pytest.raises(OSError, match="broke off"):
        kept.keep_while_reading(_spec("write", key="a" * 32), failing(), 0)
    assert os.listdir(os.path.dirname(kept.part_path("a" * 32, 0, 1))) == []


def _staged(directory, rows: int, parts: int = 3) -> list[str]:
    """A staging job's files of one logical partition: ``rows`` rows in ``parts`` files."""
    paths, batches = [], list(features_batches(rows, per_batch=rows // parts // 2, validation_every=5))
    for part in range(parts):
        paths.append(str(directory / f"part-{part:05d}-00000.arrow"))
        with pa.ipc.new_file(paths[-1], batches[0].schema) as writer:
            for batch in batches[2 * part:2 * part + 2]:
                writer.write_batch(batch)
    return paths


def test_rows_read_from_staged_files_are_kept_as_those_files_not_copied(tmp_path):
    files = _staged(tmp_path, 3000)
    batches = (batch for path in files for batch in _read_file(path))
    written = kept.keep_while_reading(_spec("write"), batches, 0, files)
    part = kept.part_path("k" * 32, 0, 1)
    assert [os.stat(os.path.join(part, name)).st_ino for name in sorted(os.listdir(part))] \
        == [os.stat(path).st_ino for path in files], "the staged files, linked in order"
    for path in files:
        os.remove(path)  # the fit ends: its staged files go, the kept part stays
    held.forget()
    rank, read = kept.take_kept(_spec("read"), iter([]), _Store(), 0)
    assert _same(read, written) and len(read.train) + len(read.validation) == 3000


def test_staged_files_on_another_disk_are_kept_by_writing_the_rows(tmp_path, monkeypatch):
    files = _staged(tmp_path, 3000)
    sizes = [os.path.getsize(path) for path in files]
    real_link = os.link

    def cross_device(source, target):  # the first file links, the second is on another file system
        if source != files[0]:
            raise OSError(18, "Invalid cross-device link")
        real_link(source, target)

    monkeypatch.setattr(os, "link", cross_device)
    batches = (batch for path in files for batch in _read_file(path))
    written = kept.keep_while_reading(_spec("write"), batches, 0, files)
    part = kept.part_path("k" * 32, 0, 1)
    assert os.listdir(part) == ["00000.arrow"] and _rows_of(part) == 3000
    assert [os.path.getsize(path) for path in files] == sizes, "no staged file was written through a link"
    held.forget()
    assert _same(kept.take_kept(_spec("read"), iter([]), _Store(), 0)[1], written)


def _read_file(path):
    reader = pa.ipc.open_file(path)
    return [reader.get_batch(index) for index in range(reader.num_record_batches)]


def test_what_a_rank_that_died_keeping_a_part_left_goes_and_what_a_live_one_makes_stays():
    path = kept.part_path("a" * 32, 0, 1)
    os.makedirs(os.path.dirname(path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    making = f"{path}.tmp-{os.getppid()}-1234"  # a live process (another fit's rank) makes it
    for name in (f"{path}.tmp-0123", f"{path}.tmp-{ended.pid}-5678", making):  # ended before their finally ran
        os.mkdir(name)
        with open(os.path.join(name, "00000.arrow"), "wb") as left:
            left.write(b"x" * 1000)
    with open(f"{path}.tmp-{ended.pid}-9999", "wb") as left:  # an older version's file
        left.write(b"x" * 1000)
    kept.keep_while_reading(_spec("write", key="a" * 32), features_batches(300), 0)
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path), os.path.basename(making)]


def test_two_fits_keeping_one_part_at_once_both_keep_it_without_warnings(caplog):
    spec = _spec("write", key="a" * 32)
    reading = features_batches(3000, seed=0)
    first = kept.keep_while_reading  # the first fit's rank is reading its rows ...

    def second_meanwhile():
        for index, batch in enumerate(reading):
            if index == 1:  # ... when the second fit's rank keeps the part first
                kept.keep_while_reading(spec, features_batches(3000, seed=0), 0)
            yield batch

    with caplog.at_level(logging.WARNING, logger="spark_torch_est.ingest.kept"):
        first(spec, second_meanwhile(), 0)
    assert "cannot keep this part's rows" not in caplog.text
    path = kept.part_path("a" * 32, 0, 1)
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    assert _rows_of(path) == 3000, "the part is complete"


def test_a_part_evicted_while_a_rank_reads_it_sends_the_fit_back_to_spark(tmp_path):
    files = _staged(tmp_path, 3000)
    kept.keep_while_reading(_spec("write", key="a" * 32), (b for path in files for b in _read_file(path)), 0, files)
    part = kept.part_path("a" * 32, 0, 1)
    reading = kept._read(part)
    next(reading)  # the first of its three files is open
    kept._evict(0, keep="b" * 32)  # another rank, over the bound
    assert not os.path.exists(part)
    with pytest.raises(kept.KeptPartMissing, match=kept.MISSING):
        list(reading)


def test_past_the_bound_the_least_recently_used_rows_go_first():
    one_part = None
    for key in ("a" * 32, "b" * 32):
        kept.keep_while_reading(_spec("write", key=key), features_batches(2000), 0)
        one_part = kept._size(kept.part_path(key, 0, 1))
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
