"""[both] Names the driver and the tasks agree on: the columns of the training frame and
the rows a training job returns."""

from __future__ import annotations

__all__ = ["input_column", "FEATURES", "LABEL", "WEIGHT", "IS_VALIDATION", "ROW_ID", "RESULT_SCHEMA", "DELIVERED"]


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

