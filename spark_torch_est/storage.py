"""Checkpoint files on any fsspec filesystem: atomic writes, a ``latest`` pointer, pruning.

A checkpoint directory looks like::

    ckpt-3f9c0a1b2d4e-ep000002-ba000000000040.pt   # run id, epoch, global step
    ckpt-3f9c0a1b2d4e-ep000003-ba000000000060.pt
    latest                      # the file name of the newest complete checkpoint

Each run prunes only its own files, so runs may share a directory.
"""

from __future__ import annotations

import posixpath
import uuid

import fsspec

__all__ = ["write_atomic", "read_bytes", "exists", "CheckpointDir"]


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
    with fs.open(tmp, "wb") as handle:
        handle.write(data)
    fs.mv(tmp, path)


def read_bytes(url: str) -> bytes:
    """Reads a whole file from a local path or fsspec URL."""
    fs, path = _fs(url)
    with fs.open(path, "rb") as handle:
        return handle.read()


def exists(url: str) -> bool:
    """Whether a file or directory exists at a local path or fsspec URL."""
    fs, path = _fs(url)
    return fs.exists(path)


class CheckpointDir:
    """Periodic checkpoints of one run in a directory.

    Args:
        url: A local path or fsspec URL (``hdfs://``, ``s3://``, ``dbfs:/``, ...).
        keep: How many of the newest checkpoints of the run to keep.
        run_id: The run's id (its first 12 characters name the files).
    """

    POINTER = "latest"

    def __init__(self, url: str, keep: int = 3, run_id: str = "") -> None:
        self.url = url.rstrip("/")
        self.keep = keep
        self.run = run_id[:12]
        self.fs, self.path = _fs(self.url)

    def write(self, data: bytes, epoch: int, global_step: int) -> str:
        """Writes one checkpoint, then points ``latest`` at it and prunes old ones."""
        name = f"ckpt-{self.run}-ep{epoch:06d}-ba{global_step:012d}.pt" if self.run else \
            f"ckpt-ep{epoch:06d}-ba{global_step:012d}.pt"
        write_atomic(f"{self.url}/{name}", data)
        write_atomic(f"{self.url}/{self.POINTER}", name.encode())
        for old in self._names()[:-self.keep]:
            self.fs.rm(f"{self.path}/{old}")
        return f"{self.url}/{name}"

    def latest(self) -> bytes | None:
        """Returns the newest complete checkpoint's bytes, or None when there is none."""
        pointer = f"{self.path}/{self.POINTER}"
        if not self.fs.exists(pointer):
            return None
        with self.fs.open(pointer, "rb") as handle:
            name = handle.read().decode().strip()
        try:
            with self.fs.open(f"{self.path}/{name}", "rb") as handle:
                return handle.read()
        except FileNotFoundError:  # pruned by another run sharing the directory
            return None

    def _names(self) -> list[str]:
        if not self.fs.exists(self.path):
            return []
        names = [posixpath.basename(p) for p in self.fs.ls(self.path, detail=False)]
        mine = f"ckpt-{self.run}-" if self.run else "ckpt-ep"
        return sorted(n for n in names if n.startswith(mine) and n.endswith(".pt"))
