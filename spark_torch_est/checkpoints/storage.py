"""[both] Checkpoint files on any fsspec filesystem: atomic writes, a ``latest`` pointer, pruning.

A checkpoint directory looks like::

    ckpt-3f9c0a1b2d4e-ep000002-ba000000000040.pt   # run id, epoch, global step
    ckpt-3f9c0a1b2d4e-ep000003-ba000000000060.pt
    latest                      # the file name of the newest complete checkpoint
    ckpt-3f9c0a1b2d4e-ba000000000060.claim           # who continues the run from that step here
    ckpt-3f9c0a1b2d4e-ep000003-ba000000000060.dcp/   # strategy="fsdp": every rank's part, beside its .pt

Each run prunes only its own files (and the temporary files a killed writer left), so
runs may share a directory. Progress is read from the names: finding the newest
checkpoint of a run reads no checkpoint. A ``latest`` pointer is only followed to a
checkpoint name in the same directory. A sharded checkpoint's folder goes with its ``.pt``:
pruned with it, and removed when it has none (a save that did not complete). A fit that
continues a run from a step claims that step first (:meth:`CheckpointDir.claim`: a file
created exclusively), so two copies of one run (two estimators loaded from one save) never
both continue it into one directory; a claim goes once the run has a newer checkpoint.

Every checkpoint file is read through :func:`open_regular`: a regular file only (never a
FIFO, a device or a symlink out of its folder, which would block a read or never end it),
and never more bytes than it had when it was opened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import re
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import fsspec

__all__ = ["write_atomic", "read_bytes", "open_regular", "iter_file", "local_path", "UnsafeFileError",
           "probe_writable", "exists", "remove", "short_run_id", "CheckpointDir", "CheckpointFile"]

logger = logging.getLogger(__name__)

_POINTER_BYTES = 4096  # a checkpoint file's name, with room to spare
_CLAIM = re.compile(r"^ckpt-(?P<run>[0-9a-f]{12})-ba(?P<step>\d{12,})\.claim$")
_NAME = re.compile(r"^ckpt-(?P<run>[0-9a-f]{12})-ep(?P<epoch>\d{6,})-ba(?P<step>\d{12,})\.pt$")


#: Chunk size of :func:`iter_file`.
CHUNK_BYTES = 4 << 20


class UnsafeFileError(OSError):
    """A checkpoint file that is not a regular file in its folder (a FIFO, a device, a
    symlink pointing out of the folder), or larger than what is read from it may be."""


def _fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def local_path(url: str) -> str | None:
    """The local path behind ``url``, or None for another filesystem."""
    fs, path = _fs(url)
    return path if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)) else None


@contextlib.contextmanager
def open_regular(url: str, limit: int | None = None) -> Iterator[tuple[BinaryIO, int]]:
    """Opens a checkpoint file for reading, if it is a regular file: the one place that
    decides what a checkpoint file may be.

    A local path is opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` (what
    is checked is what is read: no race with a file swapped in between); a symlink is followed
    only to a file within the link's own folder or a folder below it. On another fsspec
    filesystem, the store's
    listing must say "file" with a size. Opening never blocks, and a read of the size it
    yields ends.

    Args:
        url: A local path or fsspec URL.
        limit: The most bytes the file may hold (None: any size).

    Yields:
        ``(handle, size)``: the open file and its size in bytes when opened; read no more.

    Raises:
        FileNotFoundError: Nothing there.
        UnsafeFileError: Not a regular file (names it and what it is), a symlink out of its
            folder, or larger than ``limit``.
    """
    local = local_path(url)
    if local is not None:
        handle, size = _open_local(local)
    else:
        fs, path = _fs(url)
        info = fs.info(path)
        size = info.get("size")
        if info.get("type") != "file" or not isinstance(size, int):
            raise UnsafeFileError(f"{url} is not a regular file (its store lists it as {info.get('type')!r})")
        handle = fs.open(path, "rb")
    try:
        if limit is not None and size > limit:
            raise UnsafeFileError(f"{url} holds {size} bytes, more than the {limit} such a file may hold")
        yield handle, size
    finally:
        handle.close()


def _open_local(path: str) -> tuple[BinaryIO, int]:
    """A local regular file opened for reading, and its size (see :func:`open_regular`)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    target = path
    if stat.S_ISLNK(mode):
        target = os.path.realpath(path)
        folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
        if os.path.commonpath([folder, target]) != folder:
            raise UnsafeFileError(f"{path} is a symlink to {target}, out of its folder: a checkpoint file is read "
                                  "only from its own folder")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(target, flags)
    except OSError as error:
        if os.path.islink(target):  # swapped for a symlink since it was looked at
            raise UnsafeFileError(f"{path} is a symlink, not a regular file") from None
        raise error from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(f"{path} is not a regular file (it is a {_kind(info.st_mode)}); a checkpoint file "
                                  "is only read from a regular file")
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return f"file of mode {oct(mode)}"


def iter_file(url: str, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
    """A regular file's bytes in chunks (see :func:`open_regular`), no more than it had when
    opened.

    Raises:
        FileNotFoundError, UnsafeFileError: As :func:`open_regular`.
        OSError: The file shrank while it was read.
    """
    with open_regular(url) as (handle, size):
        left = size
        while left > 0:
            data = handle.read(min(chunk, left))
            if not data:
                raise OSError(f"{url} ended after {size - left} of its {size} bytes: it changed while it was read")
            left -= len(data)
            yield data


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


def read_bytes(url: str, limit: int | None = None) -> bytes:
    """Reads a whole regular file from a local path or fsspec URL (see :func:`open_regular`).

    Raises:
        FileNotFoundError: Nothing there.
        UnsafeFileError: Not a regular file (a FIFO or device would block or never end), a
            symlink out of its folder, or more than ``limit`` bytes.
        OSError: It cannot be read whole.
    """
    with open_regular(url, limit) as (handle, size):
        data = handle.read(size)
    if len(data) != size:
        raise OSError(f"{url} ended after {len(data)} of its {size} bytes: it changed while it was read")
    return data


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
    CLAIM = ".claim"

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
        claims = [n for n in names if (match := _CLAIM.match(n)) is not None and match["run"] == self.run
                  and int(match["step"]) < global_step]  # a newer checkpoint makes a fit from there branch anyway
        for old in removed + folders + claims:
            try:
                self.fs.rm(f"{self.path}/{old}", recursive=old.endswith(self.SHARDED))
            except FileNotFoundError:  # removed meanwhile
                pass
        return f"{self.url}/{name}"

    def claim(self, global_step: int, claimant: str) -> bool:
        """Claims continuing the run from ``global_step`` in this directory, atomically: the
        claim file is created exclusively (``O_EXCL``, or fsspec's ``"xb"`` where the store
        has it), never decided from a listing.

        Args:
            global_step: The step the run continues from.
            claimant: Who claims (the same claimant may claim again: a fit retried after one
                that failed).

        Returns:
            Whether ``claimant`` holds the claim; False when another one does.

        Raises:
            OSError: The directory cannot be written.
        """
        path = self._claim_path(global_step)
        self.fs.makedirs(self.path, exist_ok=True)
        if self.fs.exists(path):  # claimed already: a store that takes "xb" but overwrites (fsspec's DBFS) must
            return self._claimant(global_step) == claimant.encode()  # not hand the claim to a second claimant
        try:
            with self.fs.open(path, "xb") as handle:
                handle.write(claimant.encode())
        except FileExistsError:
            pass
        except (ValueError, NotImplementedError):  # a store without exclusive creation: the next best thing
            logger.warning("%s has no exclusive create: the claim %s is written and read back, which two fits "
                           "started at the same moment can both pass", self.url, path)
            write_atomic(f"{self.url}/{posixpath.basename(path)}", claimant.encode())
        # Read back even after an exclusive create: on a store that takes "xb" and overwrites, two
        # claimants racing past the check above both write; the last one holds the claim.
        return self._claimant(global_step) == claimant.encode()

    def release(self, global_step: int, claimant: str) -> None:
        """Gives up ``claimant``'s claim on ``global_step`` (a fit that failed or was refused),
        so a later copy of the run loaded from the same save continues it instead of branching."""
        if self._claimant(global_step) != claimant.encode():
            return
        try:
            self.fs.rm(self._claim_path(global_step))
        except FileNotFoundError:  # removed meanwhile
            pass

    def _claim_path(self, global_step: int) -> str:
        return f"{self.path}/ckpt-{self.run}-ba{global_step:012d}{self.CLAIM}"

    def _claimant(self, global_step: int) -> bytes | None:
        try:
            return read_bytes(f"{self.url}/{posixpath.basename(self._claim_path(global_step))}", limit=_POINTER_BYTES)
        except OSError:
            return None

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
        try:
            name = read_bytes(f"{self.url}/{self.POINTER}", limit=_POINTER_BYTES).decode("utf-8", "replace").strip()
        except UnsafeFileError as error:  # a FIFO would block the read
            logger.warning("ignored %s/%s: %s", self.url, self.POINTER, error)
            return None
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
