"""[both] Names the driver and the tasks agree on: the columns of the training frame and
the rows a training job returns."""

from __future__ import annotations

import struct
from collections.abc import Sequence

__all__ = ["input_column", "FEATURES", "LABEL", "WEIGHT", "IS_VALIDATION", "ROW_ID", "RESULT_SCHEMA", "DELIVERED",
           "pack_runs", "unpack_runs"]


def input_column(index: int) -> str:
    """The training frame's column of the model's input ``index``."""
    return f"__ste_input_{index}"


#: The training frame's columns (see :mod:`spark_torch_est.ingest.frames` and :mod:`spark_torch_est.ingest.tables`):
#: the inputs, then these. ``featuresCol`` / ``featureCols`` make the one input FEATURES.
FEATURES = input_column(0)
LABEL = "__ste_label"
WEIGHT = "__ste_weight"
IS_VALIDATION = "__ste_is_validation"
#: A row's place in the training frame's logical partitions (partition index in the bits
#: from 33 up, position in the partition below: Spark's ``monotonically_increasing_id``),
#: carried only by a job of another number of ranks than the run's logical partitions.
ROW_ID = "__ste_row_id"

#: Rows rank 0 returns: the checkpoint split into ordered binary chunks, or one row with
#: seq DELIVERED and the checkpoint's SHA-256 when the driver already holds it (channel).
RESULT_SCHEMA = "seq long, data binary"
DELIVERED = -1


_RUNS_MAGIC = b"STE-RUNS"
_LENGTH = struct.Struct("<Q")


def pack_runs(checkpoints: Sequence[bytes]) -> bytes:
    """The checkpoints of the runs one job trained one after another (``TaskSpec.together``),
    as rank 0 returns them: a marker, their count and lengths, then each in turn."""
    head = [_RUNS_MAGIC, _LENGTH.pack(len(checkpoints))] + [_LENGTH.pack(len(c)) for c in checkpoints]
    return b"".join(head + list(checkpoints))


def unpack_runs(data: bytes, count: int) -> list[bytes]:
    """The ``count`` checkpoints :func:`pack_runs` packed into ``data``.

    Raises:
        ValueError: ``data`` is not ``count`` packed checkpoints.
    """
    start = len(_RUNS_MAGIC) + _LENGTH.size * (count + 1)
    if len(data) < start or not data.startswith(_RUNS_MAGIC) or _LENGTH.unpack_from(data, len(_RUNS_MAGIC))[0] != count:
        raise ValueError(f"not the checkpoints of {count} runs trained together")
    lengths = [_LENGTH.unpack_from(data, len(_RUNS_MAGIC) + _LENGTH.size * (i + 1))[0] for i in range(count)]
    if start + sum(lengths) != len(data):
        raise ValueError(f"the checkpoints of {count} runs trained together do not fill their {len(data)} bytes")
    runs = []
    for length in lengths:
        runs.append(data[start:start + length])
        start += length
    return runs
