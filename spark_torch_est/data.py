"""[executor] Arrow record batches to contiguous tensors, and which rows each step takes.

The driver reduces every feature layout (a VectorUDT, an ``array<numeric>`` column or a
list of numeric columns) to one ``array<float>`` column named :data:`FEATURES`, the label
to float, long or ``array<float>`` in :data:`LABEL`, and the validation flag to a boolean
:data:`IS_VALIDATION`, all in the JVM. Here each Arrow batch becomes numpy views with no
per-row Python, and one copy concatenates them. Messages name the user's columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pyarrow as pa
import torch

from spark_torch_est.errors import InputDataError
from spark_torch_est.protocol import FEATURES, IS_VALIDATION, LABEL
from spark_torch_est.rowstore import RowStore, SpilledRows
from spark_torch_est.spec import Columns

__all__ = ["Shard", "EpochPlan", "list_column_to_matrix", "column_to_numpy", "read_shard", "shape_labels",
           "epoch_order"]


def list_column_to_matrix(array: pa.Array, name: str) -> np.ndarray:
    """Turns a list-of-numbers Arrow array into an ``(n, d)`` numpy matrix without copying
    the values where Arrow allows.

    Raises:
        InputDataError: A row or element is null, or rows differ in length.
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise InputDataError(f"column {name!r} has {array.null_count} null rows in this partition")
    if len(array) == 0:
        return np.zeros((0, 0), dtype=np.float32)
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
    else:
        lengths = np.diff(array.offsets.to_numpy())
        width = int(lengths[0])
        if not (lengths == width).all():
            raise InputDataError(
                f"column {name!r} holds arrays of different lengths "
                f"({int(lengths.min())} to {int(lengths.max())}); every row needs the same length"
            )
    values = array.flatten()
    if values.null_count:
        raise InputDataError(f"column {name!r} has {values.null_count} null elements in this partition")
    return values.to_numpy(zero_copy_only=False).reshape(len(array), width)


def column_to_numpy(array: pa.Array, name: str) -> np.ndarray:
    """Turns a numeric, boolean or list Arrow array into numpy (``(n,)`` or ``(n, d)``).

    Raises:
        InputDataError: The column has nulls or ragged arrays.
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(array.type):
        return list_column_to_matrix(array, name)
    if array.null_count:
        raise InputDataError(f"column {name!r} has {array.null_count} null values in this partition")
    return array.to_numpy(zero_copy_only=False)


@dataclass
class Shard:
    """The rows one rank trains on.

    Attributes:
        features: ``(n, d)`` float32: a tensor, or :class:`SpilledRows` read per batch
            when the partition was larger than the memory budget.
        labels: ``(n,)`` float32 or int64, or ``(n, k)`` float32.
        val_features: Validation rows' features (may have 0 rows).
        val_labels: Validation rows' labels.
    """

    features: torch.Tensor | SpilledRows
    labels: torch.Tensor
    val_features: torch.Tensor | SpilledRows
    val_labels: torch.Tensor


def read_shard(batches: Iterable[pa.RecordBatch], columns: Columns = Columns(),
               memory_budget: int | None = None) -> Shard:
    """Collects a partition's record batches into a :class:`Shard`; feature rows past
    ``memory_budget`` bytes go to local files (see :mod:`spark_torch_est.rowstore`).

    Raises:
        InputDataError: Nulls or ragged feature arrays.
    """
    store = RowStore(memory_budget)
    for batch in batches:
        if batch.num_rows == 0:
            continue
        features = list_column_to_matrix(batch.column(FEATURES), columns.features)
        labels = column_to_numpy(batch.column(LABEL), columns.label)
        if labels.dtype.kind == "f":
            labels = labels.astype(np.float32, copy=False)
        if IS_VALIDATION in batch.schema.names:
            is_val = column_to_numpy(batch.column(IS_VALIDATION), "validationIndicatorCol").astype(bool)
            store.append("val_features", features[is_val], spillable=True)
            store.append("val_labels", labels[is_val])
            features, labels = features[~is_val], labels[~is_val]
        store.append("features", features, spillable=True)
        store.append("labels", labels)
    features, labels = store.column("features"), store.column("labels")
    if features is None:
        features, labels = torch.zeros(0, 0), torch.zeros(0)
    labels = labels.float() if labels.is_floating_point() else labels.long()
    val_features, val_labels = store.column("val_features"), store.column("val_labels")
    if val_features is None:  # no validation rows: empty, with the training rows' shapes
        val_features, val_labels = torch.zeros(0, *features.shape[1:]), labels[:0]
    return Shard(features, labels, val_features, val_labels.to(labels.dtype))


def shape_labels(labels: torch.Tensor, output_shape: list[int], label_name: str) -> torch.Tensor:
    """Shapes float labels like the model's output per row, so ``Linear(d, 1)`` with
    ``MSELoss`` and a scalar label never broadcasts to ``(B, B)``.

    Raises:
        InputDataError: The model returns several values per row for a scalar float label.
    """
    if not labels.is_floating_point() or labels.dim() != 1 or output_shape == []:
        return labels
    if output_shape != [1]:
        raise InputDataError(
            f"the model returns {output_shape} values per row but labelCol {label_name!r} holds one number per row"
        )
    return labels.unsqueeze(1)


def epoch_order(num_rows: int, seed: int, epoch: int, rank: int) -> torch.Tensor:
    """The shuffled row order of one rank in one epoch, a pure function of its arguments."""
    state = np.random.SeedSequence([seed, epoch, rank]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    return torch.randperm(num_rows, generator=generator)


class EpochPlan:
    """Which rows every rank takes at each step of (the rest of) an epoch.

    All ranks take the same number of steps. Step ``k`` takes rows ``offset + k *
    batch_size`` onwards of each rank's order; a rank with fewer rows than the longest
    keeps going round its own order, so its last own batch may be partial.

    Args:
        rows: Training rows of every rank.
        batch_size: Rows per rank per step.
        offset: Rows of its order each rank already trained on in this epoch.

    >>> plan = EpochPlan([5, 4], batch_size=2, offset=2)
    >>> plan.steps, [plan.samples(k) for k in range(plan.steps)]
    (2, [4, 3])
    """

    def __init__(self, rows: list[int], batch_size: int, offset: int = 0) -> None:
        self.rows = list(rows)
        self.batch_size = batch_size
        self.offset = offset
        self.steps = max(math.ceil((max(self.rows) - offset) / batch_size), 0)

    def positions(self, order: torch.Tensor, step: int) -> torch.Tensor:
        """The positions of this rank's rows for ``step`` (counted from the plan's start)."""
        num_rows = len(order)
        start = self.offset + step * self.batch_size
        if start < num_rows:
            return order[start:start + self.batch_size]
        return order[torch.arange(start, start + self.batch_size) % num_rows]

    def samples(self, step: int) -> int:
        """Rows all ranks together train on at ``step``."""
        start = self.offset + step * self.batch_size
        return sum(min(self.batch_size, n - start) if start < n else self.batch_size for n in self.rows)
