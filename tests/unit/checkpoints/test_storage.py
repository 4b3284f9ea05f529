"""Checkpoint directories: atomic writes, pruning, leftovers of killed writers, pointers."""

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from spark_torch_est.checkpoints.storage import CheckpointDir, UnsafeFileError, iter_file, probe_writable, read_bytes

RUN = "3f9c0a1b2d4e5f60"


def test_a_directory_keeps_the_newest_and_points_at_it(tmp_path):
    directory = CheckpointDir(str(tmp_path), run_id=RUN, keep=2)
    for step in range(1, 5):
        directory.write(f"ckpt{step}".encode(), epoch=step, global_step=step * 10)
    assert len(list(tmp_path.glob("ckpt-*.pt"))) == 2 and not list(tmp_path.glob("*.tmp-*"))
    newest = directory.newest()
    assert (newest.epoch, newest.global_step, newest.read()) == (4, 40, b"ckpt4")
    assert directory.latest() == newest


def test_progress_comes_from_names_and_runs_sharing_a_directory_stay_apart(tmp_path):
    mine, other = CheckpointDir(str(tmp_path), run_id=RUN), CheckpointDir(str(tmp_path), run_id="aaaaaaaaaaaa")
    mine.write(b"x", epoch=2, global_step=20)
    other.write(b"y", epoch=9, global_step=90)
    (tmp_path / f"ckpt-{RUN[:12]}-ep000003-ba000000000030.pt").write_bytes(b"not even a checkpoint")
    assert mine.newest().global_step == 30  # read from the name alone
    assert other.newest().global_step == 90


def test_leftovers_of_a_killed_writer_are_removed_at_the_next_write(tmp_path):
    leftover = tmp_path / f"ckpt-{RUN[:12]}-ep000001-ba000000000010.pt.tmp-deadbeef"
    foreign = tmp_path / "ckpt-aaaaaaaaaaaa-ep000001-ba000000000010.pt.tmp-deadbeef"
    leftover.write_bytes(b"half")
    foreign.write_bytes(b"another run may still be writing this")
    CheckpointDir(str(tmp_path), run_id=RUN).write(b"x", epoch=1, global_step=12)
    assert not leftover.exists() and foreign.exists()


def test_a_pointer_that_leaves_the_directory_is_refused(tmp_path, caplog):
    (tmp_path / "outside.pt").write_bytes(b"secret")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "latest").write_text("../outside.pt")
    with caplog.at_level(logging.WARNING):
        assert CheckpointDir(str(tmp_path / "dir")).latest() is None
    assert "not a checkpoint file in that directory" in caplog.text
    (tmp_path / "dir" / "latest").write_text("/etc/passwd")
    assert CheckpointDir(str(tmp_path / "dir")).latest() is None


def test_an_empty_or_missing_directory_has_no_checkpoint(tmp_path):
    assert CheckpointDir(str(tmp_path / "none"), run_id=RUN).newest() is None
    assert CheckpointDir(str(tmp_path / "none")).latest() is None


def test_a_write_at_an_earlier_point_removes_no_later_point_of_the_run(tmp_path):
    """Fits never go back within a run (a fit from an earlier point is a branch, a new run),
    so pruning never removes another point's files, nor the one just written."""
    directory = CheckpointDir(str(tmp_path), run_id=RUN)
    for epoch in (6, 7, 8):
        directory.write(b"old", epoch=epoch, global_step=epoch * 10)
    directory.write(b"new", epoch=4, global_step=40)
    assert directory.newest().global_step == 80
    assert sorted(int(p.name[-15:-3]) for p in tmp_path.glob("ckpt-*.pt")) == [40, 60, 70, 80]


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    """A real write failure: the file size limit of a child process (EFBIG, as ENOSPC would)."""
    probe = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, ".")
        from spark_torch_est.checkpoints.storage import CheckpointDir
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            CheckpointDir({str(tmp_path)!r}, run_id={RUN!r}).write(b"x" * 100_000, epoch=1, global_step=10)
        except OSError as error:
            print("refused:", error.errno)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("refused:"), out.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_pointer_or_checkpoint_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, caplog):
    os.mkfifo(tmp_path / "latest")
    with caplog.at_level(logging.WARNING, logger="spark_torch_est.checkpoints.storage"):
        assert CheckpointDir(str(tmp_path)).latest() is None
    assert "latest is not a regular file (it is a FIFO)" in caplog.text
    os.mkfifo(tmp_path / "ckpt.pt")
    with pytest.raises(UnsafeFileError, match="ckpt.pt is not a regular file"):
        read_bytes(str(tmp_path / "ckpt.pt"))


@pytest.mark.timeout(30)
def test_a_symlink_to_a_device_or_out_of_its_folder_is_refused_at_once_naming_it(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    (tmp_path / "outside.pt").write_bytes(b"someone else's file")
    (folder / "inside.pt").write_bytes(b"a checkpoint")
    os.symlink("/dev/zero", folder / "zero.pt")
    os.symlink(tmp_path / "outside.pt", folder / "out.pt")
    os.symlink("inside.pt", folder / "alias.pt")
    started = time.monotonic()
    with pytest.raises(UnsafeFileError, match=r"zero.pt is a symlink to /dev/zero, out of its folder"):
        read_bytes(str(folder / "zero.pt"))
    with pytest.raises(UnsafeFileError, match=r"out.pt is a symlink to .*outside.pt, out of its folder"):
        list(iter_file(str(folder / "out.pt")))
    assert time.monotonic() - started < 5
    assert read_bytes(str(folder / "alias.pt")) == b"a checkpoint"  # a link within the folder is followed
    os.symlink("/dev/zero", folder / "latest")
    assert CheckpointDir(str(folder)).latest() is None


def test_a_file_is_read_up_to_its_size_and_a_limit(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert read_bytes(str(tmp_path / "f"), limit=100) == b"x" * 100
    with pytest.raises(UnsafeFileError, match="f holds 100 bytes, more than the 99"):
        read_bytes(str(tmp_path / "f"), limit=99)
    with pytest.raises(UnsafeFileError, match="not a regular file .it is a directory"):
        read_bytes(str(tmp_path))


def test_a_directory_is_probed_for_writing(tmp_path):
    probe_writable(str(tmp_path / "new" / "dir"))
    assert list((tmp_path / "new" / "dir").iterdir()) == []
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        with pytest.raises(OSError):
            probe_writable(str(tmp_path / "ro"))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        probe_writable(str(tmp_path / "file"))


def test_one_of_many_claimants_racing_for_a_run_s_step_gets_it_and_keeps_it(tmp_path):
    import threading

    directory = CheckpointDir(str(tmp_path), run_id=RUN)
    start = threading.Barrier(8)
    won: list[str] = []

    def claim(who: str) -> None:
        start.wait(timeout=30)
        if CheckpointDir(str(tmp_path), run_id=RUN).claim(40, who):
            won.append(who)

    threads = [threading.Thread(target=claim, args=(f"copy{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(won) == 1
    assert directory.claim(40, won[0]) and not directory.claim(40, "another copy")  # a retried fit keeps it
    assert directory.claim(41, "another copy")  # another step is another claim
    directory.write(b"x", epoch=3, global_step=60)  # a newer checkpoint: older claims go
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".claim")) == []
    assert directory.newest().global_step == 60


def test_a_store_that_overwrites_on_exclusive_create_does_not_hand_a_claim_to_a_second_claimant():
    """fsspec's DBFS takes "xb" and overwrites (DBFS cannot run here: a memory store that does
    the same stands in); a claimed step stays its first claimant's."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Overwriting(MemoryFileSystem):
        protocol = "overwritingxb"

        def _open(self, path, mode="rb", **kwargs):
            return super()._open(path, "wb" if mode == "xb" else mode, **kwargs)

    fsspec.register_implementation("overwritingxb", Overwriting, clobber=True)
    directory = CheckpointDir("overwritingxb://claims", run_id=RUN)
    assert directory.claim(40, "first")
    assert not directory.claim(40, "second") and directory.claim(40, "first")
