"""[both] Names the driver and the tasks agree on: the columns of the training frame, the
rows a training job returns, and the store keys of failure reports."""

from __future__ import annotations

__all__ = ["FEATURES", "LABEL", "IS_VALIDATION", "RESULT_SCHEMA", "DELIVERED", "failure_key"]

#: The training frame's columns (see :mod:`spark_torch_est.frames` and :mod:`spark_torch_est.data`).
FEATURES = "__ste_features"
LABEL = "__ste_label"
IS_VALIDATION = "__ste_is_validation"

#: Rows rank 0 returns: the checkpoint split into ordered binary chunks, or one row with
#: seq DELIVERED and the checkpoint's SHA-256 when the driver already holds it (channel).
RESULT_SCHEMA = "seq long, data binary"
DELIVERED = -1


def failure_key(rank: int) -> str:
    """The store key (under the job's prefix) where a rank leaves its sealed failure report."""
    return f"failure/{rank}"
