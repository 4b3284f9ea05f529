"""[both] Checkpoint files on any fsspec filesystem: atomic writes, a ``latest`` pointer, pruning.

A checkpoint directory looks like::

    ckpt-3f9c0a1b2d4e-ep000002-ba000000000040.pt   # run id, epoch, global step
    ckpt-3f9c0a1b2d4e-ep000003-ba000000000060.pt
    latest                      # the file name of the newest complete checkpoint
    ckpt-3f9c0a1b2d4e-ep000003-ba000000000060.dcp/   # strategy="fsdp": every rank's part, beside its .pt

Each run prunes only its own files (and the temporary files a killed writer left), so
runs may share a directory. Progress is read from the names: finding the newest
checkpoint of a run reads no checkpoint. A ``latest`` pointer is only followed to a
checkpoint name in the same directory. A sharded checkpoint's folder goes with its ``.pt``:
pruned with it, and removed when it has none (a save that did not complete).
"""

from __future__ import annotations

import logging
import posixpath
import re
import uuid
from dataclasses import dataclass

import fsspec

__all__ = ["write_atomic", "read_bytes", "probe_writable", "exists", "remove", "short_run_id", "CheckpointDir",
           "CheckpointFile"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(?P<run>[0-9a-f]{12})-ep(?P<epoch>\d{6,})-ba(?P<step>\d{12,})\.pt$")


def _fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def write_atomic(url: str, data: bytes) -> None:
    """Writes ``data`` to a temporary file beside ``url`` and renames it into place."""
    fs, path = _fs(url)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with fs.open(tmp, "wb") as handle:
            handle.write(data)
        fs.mv(tmp, path)
    except BaseException:  # a full disk, a lost connection, an interrupt: leave no partial file behind
        try:
            fs.rm(tmp)
        except Exception as error:  # the original error is the one to raise
            logger.debug("could not remove %s: %s", tmp, error)
        raise


def read_bytes(url: str) -> bytes:
    """Reads a whole regular file from a local path or fsspec URL.

    Raises:
        OSError: Nothing readable there, or not a regular file (a FIFO or device would
            block or never end).
    """
    fs, path = _fs(url)
    if not fs.isfile(path):
        raise FileNotFoundError(f"{url} is not a regular file")
    with fs.open(path, "rb") as handle:
        return handle.read()


def probe_writable(url: str) -> None:
    """Creates ``url`` if needed and writes, renames and removes a small file there.

    Raises:
        OSError: The directory cannot be created or written.
    """
    fs, path = _fs(url.rstrip("/"))
    probe = f"{path}/.probe-{uuid.uuid4().hex}"
    write_atomic(probe, b"spark_torch_est write probe")
    fs.rm(probe)


def remove(url: str) -> None:
    """Removes a file or a folder and all it holds, if there is one (a local path or fsspec URL)."""
    fs, path = _fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def exists(url: str) -> bool:
    """Whether a file or directory exists at a local path or fsspec URL."""
    fs, path = _fs(url)
    return fs.exists(path)


@dataclass(frozen=True)
class CheckpointFile:
    """One checkpoint in a directory, described by its name.

    Attributes:
        url: Where it is.
        epoch: Completed epochs at the checkpoint.
        global_step: Optimizer steps at the checkpoint.
    """

    url: str
    epoch: int
    global_step: int

    def read(self) -> bytes:
        """The checkpoint's bytes."""
        return read_bytes(self.url)


def short_run_id(run_id: str) -> str:
    """The first 12 characters of a run id: what names the run's checkpoint files and the
    loggers' folders (short, and unique enough for the runs that share a directory).

    >>> short_run_id("3f9c0a1b2d4e5f60718293a4b5c6d7e8")
    '3f9c0a1b2d4e'
    """
    return run_id[:12]


class CheckpointDir:
    """Periodic checkpoints of one run in a directory.

    Args:
        url: A local path or fsspec URL (``hdfs://``, ``s3://``, ``dbfs:/``, ...).
        run_id: The run's id (its first 12 characters name the files); "" reads only
            the ``latest`` pointer.
        keep: How many of the newest checkpoints of the run to keep (default 3).
    """

    POINTER = "latest"
    SHARDED = ".dcp"

    def __init__(self, url: str, run_id: str = "", keep: int = 3) -> None:
        self.url = url.rstrip("/")
        self.run = short_run_id(run_id)
        self.keep = keep
        self.fs, self.path = _fs(self.url)

    def write(self, data: bytes, epoch: int, global_step: int) -> str:
        """Writes one checkpoint, points ``latest`` at it, and prunes the run's older
        checkpoints and leftover temporary files: only this run's own files (a run never
        goes back to an earlier point: a fit from one is a new run, see
        :func:`spark_torch_est.planning.run_of`)."""
        name = self._name(epoch, global_step) + ".pt"
        write_atomic(f"{self.url}/{name}", data)
        write_atomic(f"{self.url}/{self.POINTER}", name.encode())
        names = self._names()
        stale = [n for n in names if n.startswith(f"ckpt-{self.run}-") and ".pt.tmp-" in n]
        mine = sorted(n for n in names if (parsed := self._parse(n)) is not None and parsed[0] == self.run)
        removed = stale + [n for n in mine[:-self.keep] if n != name]
        left = {n[:-len(".pt")] for n in mine if n not in removed}
        folders = [n for n in names if n.startswith(f"ckpt-{self.run}-") and n.endswith(self.SHARDED)
                   and n[:-len(self.SHARDED)] not in left]
        for old in removed + folders:
            try:
                self.fs.rm(f"{self.path}/{old}", recursive=old.endswith(self.SHARDED))
            except FileNotFoundError:  # removed meanwhile
                pass
        return f"{self.url}/{name}"

    def sharded_url(self, epoch: int, global_step: int) -> str:
        """The folder for every rank's part of a sharded checkpoint (see
        :mod:`spark_torch_est.train.strategies.fsdp`); its ``.pt`` is written by :meth:`write` once all are written."""
        return f"{self.url}/{self._name(epoch, global_step)}{self.SHARDED}"

    def _name(self, epoch: int, global_step: int) -> str:
        return f"ckpt-{self.run}-ep{epoch:06d}-ba{global_step:012d}"

    def newest(self) -> CheckpointFile | None:
        """The run's checkpoint with the most optimizer steps, or None (read from names)."""
        return next(iter(self.files()), None)

    def files(self) -> list[CheckpointFile]:
        """The run's checkpoints, the most optimizer steps first (read from names)."""
        files = [CheckpointFile(f"{self.url}/{n}", parsed[1], parsed[2])
                 for n in self._names() if (parsed := self._parse(n)) is not None and parsed[0] == self.run]
        return sorted(files, key=lambda f: f.global_step, reverse=True)

    def latest(self) -> CheckpointFile | None:
        """The checkpoint the ``latest`` pointer names, or None when there is none. A
        pointer to anything but a checkpoint name in this directory is refused (logged)."""
        pointer = f"{self.path}/{self.POINTER}"
        if not self.fs.exists(pointer):
            return None
        if not self.fs.isfile(pointer):  # a FIFO would block the read
            logger.warning("ignored %s/%s: it is not a regular file", self.url, self.POINTER)
            return None
        with self.fs.open(pointer, "rb") as handle:
            name = handle.read(200).decode("utf-8", "replace").strip()
        parsed = self._parse(name)
        if parsed is None:
            logger.warning("ignored %s/%s: it names %r, not a checkpoint file in that directory", self.url,
                           self.POINTER, name)
            return None
        return CheckpointFile(f"{self.url}/{name}", parsed[1], parsed[2])

    @staticmethod
    def _parse(name: str) -> tuple[str, int, int] | None:
        match = _NAME.match(name)
        return (match["run"], int(match["epoch"]), int(match["step"])) if match else None

    def _names(self) -> list[str]:
        if not self.fs.exists(self.path):
            return []
        return [posixpath.basename(p) for p in self.fs.ls(self.path, detail=False)]
