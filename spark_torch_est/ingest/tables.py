"""[executor] Arrow record batches to typed columns: a rank's :class:`IngestedRows`.

Every column keeps its type (see :mod:`spark_torch_est.core.schema`): each Arrow batch becomes
numpy views with no per-row Python, and one copy per column puts the rows into a tensor
(or a spill file past the memory budget). Messages name the user's columns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from spark_torch_est.core.arrow import to_numpy
from spark_torch_est.core.protocol import IS_VALIDATION, LABEL, ROW_ID, WEIGHT, input_column
from spark_torch_est.core.schema import FEATURES_LAYOUT, InputSchema
from spark_torch_est.core.spec import ColumnNames
from spark_torch_est.errors import InputDataError
from spark_torch_est.ingest.columns import Budget, Column, ColumnBuilder, RaggedColumn

__all__ = ["Table", "IngestedRows", "arrow_values", "vectors_to_matrix", "list_column_to_matrix", "stack_columns",
           "read_rows", "TORCH_DTYPES"]

#: The schema's dtype names as torch dtypes.
TORCH_DTYPES = {"int64": torch.int64, "float32": torch.float32, "bool": torch.bool, "uint8": torch.uint8}
_DENSE_VECTOR = 1


def arrow_values(array: pa.Array, name: str,
                 parts: tuple[str, ...] | None = None) -> tuple[np.ndarray, np.ndarray | None, tuple[int, ...]]:
    """An Arrow column as numpy without per-row Python; ``parts`` names the columns whose
    values make each row of an array column (``featureCols``), for messages.

    Returns:
        ``(values, lengths, inner)``: for one number per row, ``(values (n,), None, ())``;
        for arrays, binary and Vectors, every row's values one after the other, the
        rows' lengths, and the shape of one element (``()``, or the inner sizes of an
        array of arrays).

    Raises:
        InputDataError: Nulls, or arrays of arrays whose inner sizes differ.
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    kind = array.type
    if array.null_count:
        scalar = pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind) \
            or pa.types.is_decimal(kind)
        raise InputDataError(f"column {name!r} has {array.null_count} null {'values' if scalar else 'rows'} in "
                             "this partition")
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        offsets = np.frombuffer(array.buffers()[1], dtype=np.int64 if pa.types.is_large_binary(kind) else np.int32)
        offsets = offsets[array.offset:array.offset + len(array) + 1]
        data = array.buffers()[2]
        values = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
        return values[offsets[0]:offsets[-1]], np.diff(offsets).astype(np.int64), ()
    if pa.types.is_fixed_size_binary(kind):
        width = kind.byte_width
        start = array.offset * width
        values = np.frombuffer(array.buffers()[1], dtype=np.uint8)[start:start + len(array) * width]
        return values, np.full(len(array), width, dtype=np.int64), ()
    if pa.types.is_struct(kind):  # a Spark ML Vector
        matrix = vectors_to_matrix(array, name)
        return matrix.reshape(-1), np.full(len(array), matrix.shape[1], dtype=np.int64), ()
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        lengths = (np.full(len(array), kind.list_size, dtype=np.int64) if pa.types.is_fixed_size_list(kind)
                   else np.diff(to_numpy(array.offsets)).astype(np.int64))
        flat = array.flatten()
        if flat.null_count:
            raise InputDataError(_null_elements(name, flat, lengths, parts))
        values, inner_lengths, inner = arrow_values(flat, name)
        if inner_lengths is None:
            return values, lengths, ()
        if len(inner_lengths) and not (inner_lengths == inner_lengths[0]).all():
            raise InputDataError(
                f"column {name!r} holds arrays of arrays whose inner arrays differ in length "
                f"({int(inner_lengths.min())} to {int(inner_lengths.max())}); only the outer arrays may differ"
            )
        width = int(inner_lengths[0]) if len(inner_lengths) else 0
        return values.reshape(len(inner_lengths), width, *inner), lengths, (width, *inner)
    if pa.types.is_decimal(kind):
        array = array.cast(pa.float64())
    return to_numpy(array), None, ()


def _null_elements(name: str, flat: pa.Array, lengths: np.ndarray, parts: tuple[str, ...] | None) -> str:
    """What to say about null values inside an array column: for one made of ``parts``
    (featureCols), which of those columns hold them."""
    if not parts:
        return f"column {name!r} has {flat.null_count} null elements in this partition"
    nulls = np.flatnonzero(to_numpy(flat.is_null()))
    positions = nulls - np.repeat(np.cumsum(lengths) - lengths, lengths)[nulls]
    counts = np.bincount(positions, minlength=len(parts))
    per_column = ", ".join(f"{parts[i]!r} has {int(count)}" for i, count in enumerate(counts) if count)
    return (f"featureCols: column {per_column} null values in this partition; drop or fill them first, e.g. "
            f"df.na.drop(subset={[parts[i] for i in np.flatnonzero(counts)]!r})")


def vectors_to_matrix(array: pa.StructArray, name: str) -> np.ndarray:
    """Spark ML Vectors, as Arrow carries VectorUDT (a struct of type, size, indices and
    values; type 0 is sparse, 1 dense), as an ``(n, d)`` float32 matrix, without per-row Python.

    Raises:
        InputDataError: A row is null, or the vectors differ in size.
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise InputDataError(f"column {name!r} has {array.null_count} null rows in this batch")
    rows = len(array)
    dense = to_numpy(array.field("type")) == _DENSE_VECTOR
    values = array.field("values")
    if dense.all():
        return list_column_to_matrix(values, name).astype(np.float32, copy=False)
    offsets = to_numpy(values.offsets)
    offsets = offsets - offsets[0]  # a sliced array's offsets do not start at 0
    lengths = np.diff(offsets)
    sizes = np.where(dense, lengths, to_numpy(array.field("size").fill_null(0)))
    if not (sizes == sizes[0]).all():
        raise InputDataError(f"column {name!r} holds vectors of sizes {int(sizes.min())} to {int(sizes.max())}; "
                             "every row needs the same size")
    row_of_value = np.repeat(np.arange(rows), lengths)
    position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    sparse_value = ~dense[row_of_value]
    position[sparse_value] = to_numpy(array.field("indices").flatten())
    matrix = np.zeros((rows, int(sizes[0])), dtype=np.float32)
    matrix[row_of_value, position] = to_numpy(values.flatten())
    return matrix


def list_column_to_matrix(array: pa.Array, name: str) -> np.ndarray:
    """A column of equally long arrays (or Vectors) as an ``(n, d)`` matrix.

    Raises:
        InputDataError: A row or element is null, or rows differ in length.
    """
    values, lengths, _ = arrow_values(array, name)
    if lengths is None:
        return values.reshape(-1, 1)
    if len(lengths) == 0:
        return np.zeros((0, 0), dtype=values.dtype)
    if not (lengths == lengths[0]).all():
        raise InputDataError(
            f"column {name!r} holds arrays of different lengths ({int(lengths.min())} to {int(lengths.max())}); "
            "every row needs the same length"
        )
    return values.reshape(len(lengths), int(lengths[0]))


def stack_columns(arrays: Sequence[pa.Array], names: Sequence[str]) -> np.ndarray:
    """Numeric columns side by side as one ``(n, k)`` float32 matrix (``featureCols``),
    without per-row Python.

    Raises:
        InputDataError: A column has nulls.
    """
    return np.stack([arrow_values(array, name)[0].astype(np.float32, copy=False)
                     for array, name in zip(arrays, names)], axis=1)


@dataclass
class Table:
    """One role's rows of one rank (training or validation), as columns: the model's
    inputs, the labels and the sample weights.

    Attributes:
        inputs: One column per model input, in call order.
        labels: The labels (in RAM).
        weights: The sample weights, or None without ``weightCol``.
    """

    inputs: list[Column]
    labels: Column
    weights: Column | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def columns(self) -> list[Column]:
        """Every column, in a fixed order (inputs, labels, weights)."""
        return [*self.inputs, self.labels, *([self.weights] if self.weights is not None else [])]

    def with_columns(self, columns: list[Column]) -> Table:
        """A table of ``columns`` in :meth:`columns` order."""
        count = len(self.inputs)
        return Table(list(columns[:count]), columns[count], columns[count + 1] if self.weights is not None else None)

    def take(self, positions: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """The rows at ``positions``: ``(inputs, labels, weights)``."""
        return ([column.take(positions) for column in self.inputs], self.labels.take(positions),
                self.weights.take(positions) if self.weights is not None else None)

    def slice(self, start: int, stop: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """Rows ``start`` to ``stop``: ``(inputs, labels, weights)``."""
        return ([column.slice(start, stop) for column in self.inputs], self.labels.slice(start, stop),
                self.weights.slice(start, stop) if self.weights is not None else None)


@dataclass
class IngestedRows:
    """The rows one rank ingested: its training table and its validation table (either
    may be None when the partition has none).

    A worker may hold them for a later fit (:mod:`~spark_torch_est.ingest.held`); once a fit
    laid the training rows out in the run's logical shards (in position order, or with
    ``slots`` where a move kept them in the order they arrived), the held rows stay that way
    (one copy of the rows, not two), so a later fit on the same rows and ranks trains on them
    without laying them out again.

    Attributes:
        source: What the rows were read from, for rows a later fit may find held; "" for
            rows that came from the job's input.
        layout: ``""`` while the training rows are as read; else the layout they are in
            (see :func:`~spark_torch_est.ingest.agreement.agree_on_rows`).
        reread: Reads the rows as they were read, again (for held rows laid out by an
            earlier fit that this fit cannot use).
        row_ids: The training rows' ids in the training frame, where it carries them (a
            job of another number of ranks than the run's logical partitions, see
            :data:`~spark_torch_est.core.protocol.ROW_ID`), else None.
        slots: Of training rows laid out by a move: where ``train`` holds the row of each
            position in the rank's logical shard (None: row ``i`` is position ``i``).
    """

    train: Table | None
    validation: Table | None
    source: str = ""
    layout: str = ""
    reread: Callable[[], IngestedRows] | None = None
    row_ids: torch.Tensor | None = None
    slots: torch.Tensor | None = None


def read_rows(batches: Iterable[pa.RecordBatch], schema: InputSchema, columns: ColumnNames = ColumnNames(),
              memory_budget: int | None = None, rows: int | None = None) -> IngestedRows:
    """Collects a partition's record batches (training-frame columns) into
    :class:`IngestedRows`; input rows past ``memory_budget`` bytes go to local files. When the
    partition's ``rows`` are known, each column fills one buffer as the batches come (see
    :class:`columns.ColumnBuilder`).

    Raises:
        InputDataError: Nulls, arrays that cannot be stacked, labels of mixed lengths,
            negative or non-finite weights.
    """
    budget = Budget(memory_budget)
    parts = {role: _Builders(schema, budget, rows) for role in ("train", "validation")}
    feature_cols = columns.features if schema.layout == FEATURES_LAYOUT else None
    row_ids = list[np.ndarray]()
    for batch in batches:
        if batch.num_rows == 0:
            continue
        row = ([arrow_values(batch.column(input_column(i)), column.name, feature_cols)
                for i, column in enumerate(schema.columns)],
               arrow_values(batch.column(LABEL), columns.label),
               _weights(batch.column(WEIGHT), columns.weight) if columns.weight is not None else None)
        ids = to_numpy(batch.column(ROW_ID)) if ROW_ID in batch.schema.names else None
        if IS_VALIDATION in batch.schema.names:
            flags = arrow_values(batch.column(IS_VALIDATION), "validationIndicatorCol")[0].astype(bool)
            parts["validation"].append(*_rows_where(row, flags))
            row, ids = _rows_where(row, ~flags), ids[~flags] if ids is not None else None
        parts["train"].append(*row)
        if ids is not None:
            row_ids.append(ids)
    return IngestedRows(parts["train"].finish(schema.padding_value, columns.label),
                        parts["validation"].finish(schema.padding_value, columns.label),
                        row_ids=torch.from_numpy(np.concatenate(row_ids)).to(torch.int64) if row_ids else None)


_Values = tuple[np.ndarray, "np.ndarray | None", tuple[int, ...]]


def _weights(array: pa.Array, name: str) -> _Values:
    values, _, inner = arrow_values(array, name)
    values = values.astype(np.float32, copy=False)
    if not (np.isfinite(values).all() and (values >= 0).all()):
        raise InputDataError(f"weightCol {name!r} holds negative, NaN or infinite weights; weights must be finite "
                             "and at least 0")
    return values, None, inner


def _rows_where(columns, mask: np.ndarray):
    """The rows of one column's values (or of a list or tuple of them) where ``mask`` holds."""
    if columns is None:
        return None
    if isinstance(columns, list) or (isinstance(columns, tuple) and not isinstance(columns[0], np.ndarray)):
        return type(columns)(_rows_where(column, mask) for column in columns)
    values, lengths, inner = columns
    if lengths is None:
        return values[mask], None, inner
    return values[np.repeat(mask, lengths)], lengths[mask], inner


class _Builders:
    """The builders of one role's columns."""

    def __init__(self, schema: InputSchema, budget: Budget, capacity: int | None) -> None:
        self.inputs = [ColumnBuilder(TORCH_DTYPES[column.dtype], budget, capacity) for column in schema.columns]
        self.labels: ColumnBuilder | None = None
        self.weights = ColumnBuilder(torch.float32, capacity=capacity)
        self.capacity = capacity

    def append(self, inputs: list[_Values], labels: _Values, weights: _Values | None) -> None:
        for builder, (values, lengths, inner) in zip(self.inputs, inputs):
            builder.append(values, lengths, inner)
        values, lengths, inner = labels
        if self.labels is None:
            self.labels = ColumnBuilder(torch.int64 if values.dtype.kind in "iu" else torch.float32,
                                      capacity=self.capacity)
        self.labels.append(values, lengths, inner)
        if weights is not None:
            self.weights.append(weights[0])

    def finish(self, padding: float, label_name: str) -> Table | None:
        if self.labels is None or self.labels.rows == 0:
            return None
        labels = self.labels.finish_column()
        if isinstance(labels, RaggedColumn):
            raise InputDataError(f"labelCol {label_name!r} holds arrays of different lengths; every label needs "
                                 "the same length")
        return Table([builder.finish_column(padding) for builder in self.inputs], labels, self.weights.finish())
