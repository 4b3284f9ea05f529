"""[both] What identifies a file's content for the package: its size and stamps (whatever its
filesystem says changes with any rewrite) and, for Parquet, a digest of its footer.

The Parquet plan records both when it plans a read, a rank checks them before it reads,
kept rows are keyed by them, and :mod:`~spark_torch_est.core.jvm` uses them for local files of
a query plan (Hadoop's status elsewhere).
"""

from __future__ import annotations

import hashlib
from typing import BinaryIO

import fsspec

__all__ = ["file_stamp", "footer_digest"]

_FOOTER_TAIL = 8  # the footer's length (4 bytes, little-endian) and b"PAR1"


def file_stamp(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, str]:
    """A file's size and what its filesystem says changes with any rewrite: modification
    and change times and inode (a rewrite keeping the size and setting the mtime back
    still has a new change time)."""
    info = fs.info(path)
    modified = info.get("mtime", info.get("LastModified"))
    return int(info["size"]), f"{modified}/{info.get('created')}/{info.get('ino')}"


def footer_digest(handle: BinaryIO, size: int) -> str:
    """A digest of a Parquet file's footer (its schema, row groups, offsets and statistics):
    a file rewritten with other rows has another one, whatever its size and mtime say.

    Raises:
        ValueError: The file does not end as a Parquet file does.
    """
    if size < 2 * _FOOTER_TAIL:
        raise ValueError(f"a file of {size} bytes is not a Parquet file")
    handle.seek(size - _FOOTER_TAIL)
    tail = handle.read(_FOOTER_TAIL)
    length = int.from_bytes(tail[:4], "little")
    if tail[4:] != b"PAR1" or length > size - 2 * _FOOTER_TAIL:
        raise ValueError("the file does not end with a Parquet footer")
    handle.seek(size - _FOOTER_TAIL - length)
    return hashlib.sha256(handle.read(length)).hexdigest()[:32]
