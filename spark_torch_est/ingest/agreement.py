"""[executor] What the ranks agree on before the first step, and labels shaped to the model.

Each rank shares its row counts and the layout of each of its columns (see :func:`layout`)
in one all-reduce. Every column then takes one layout on all ranks (:func:`agree`,
:func:`conform`: arrays padded per batch where lengths differ), the training rows are
laid out in the run's logical shards (see :mod:`spark_torch_est.ingest.canonical`), so all
ranks take the same steps per epoch and an epoch's order does not depend on the world size
(:func:`agree_on_rows`). Once the model's output shape is known, labels take the
shape the loss expects beside it, never by broadcasting (:func:`shape_labels`).
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spark_torch_est.core.ranks import Ranks
from spark_torch_est.core.schema import FEATURES_LAYOUT
from spark_torch_est.core.spec import TaskSpec
from spark_torch_est.errors import InputDataError
from spark_torch_est.ingest import held
from spark_torch_est.ingest.canonical import (
    CanonicalRows,
    EpochPlan,
    EpochRows,
    by_partition_order,
    by_source_order,
    epoch_offset,
    to_canonical,
)
from spark_torch_est.ingest.columns import Column, DenseColumn, RaggedColumn
from spark_torch_est.ingest.tables import TORCH_DTYPES, IngestedRows, Table

__all__ = ["AgreedRows", "agree_on_rows", "layout", "agree", "conform", "Agreed", "shape_labels", "LAYOUT_SIZE"]

logger = logging.getLogger(__name__)


@dataclass
class AgreedRows:
    """A rank's rows once every rank agreed on them.

    Attributes:
        canonical: This rank's training rows in the run's logical shards, each column in
            its agreed layout.
        validation: This rank's validation rows (maybe none), in the same layouts.
        val_rows: Validation rows of all ranks together.
    """

    canonical: CanonicalRows
    validation: Table
    val_rows: int

    @property
    def train(self) -> Table:
        """The training rows this rank holds now."""
        return self.canonical.table

    @property
    def train_rows(self) -> list[int]:
        """Training rows of every logical shard."""
        return self.canonical.shard_rows

    @property
    def shards(self) -> int:
        """The run's logical shards."""
        return self.canonical.shards

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of a whole epoch, the same on every rank."""
        return self.steps_left(0)

    def offset(self, done: int) -> int:
        """Rows of each logical shard's order trained once an epoch's steps trained ``done`` rows."""
        return epoch_offset(self.train_rows, done)

    def steps_left(self, offset: int) -> int:
        """Optimizer steps of an epoch from ``offset`` rows of each logical shard's order on."""
        return EpochPlan(self.train_rows, self.canonical.shard_batch, offset).steps

    def epoch(self, epoch: int, offset: int) -> EpochRows:
        """Collective (on another world size than the run's shards): the rows this rank
        trains in ``epoch`` from ``offset`` rows of each logical shard's order on."""
        return self.canonical.epoch(epoch, offset)

    def shape_labels(self, output_shape: list[int], label_name: str, as_read: bool = False) -> None:
        """Gives both tables' labels the shape the loss expects beside a model output of
        ``output_shape`` per row (see :func:`shape_labels`), in tables of their own (a
        worker's held rows keep their labels as read, for a later fit's model)."""
        shaped = []
        for table in (self.train, self.validation):
            if not isinstance(table.labels, DenseColumn):  # labels never spill and are never ragged
                raise TypeError(f"labels must be a DenseColumn, got {type(table.labels).__name__}")
            labels = DenseColumn(shape_labels(table.labels.tensor, output_shape, label_name, as_read))
            shaped.append(Table(table.inputs, labels, table.weights))
        self.canonical.table, self.validation = shaped


def agree_on_rows(ingested: IngestedRows, spec: TaskSpec, ranks: Ranks, shards: int | None = None) -> AgreedRows:
    """Collective: shares every rank's row counts and column layouts, gives each column one
    layout on all ranks and lays the training rows out in the run's ``shards`` logical
    shards (None: a new run, one per rank), each taking ``ceil(global batch / shards)``
    rows per step.

    Training rows the worker holds for later fits (:mod:`~spark_torch_est.ingest.held`) stay
    laid out (``ingested.train`` is replaced, so the rows are held once): when every rank of a
    later fit holds its part of the same layout (the same sources, ranks and logical shards),
    nothing is hashed or moved; when only some do, those read their rows again first. A
    layout that moves rows gives the memory of the rows sent back as it goes, so held rows
    whose layout a failure cut short are read again too.

    Raises:
        InputDataError: Ranks hold rows that cannot take one layout, rows do not fit
            ``inputShapes``, or a rank has no training rows.
    """
    shards = shards or ranks.world_size
    holdable = spec.source is not None or spec.kept is not None  # the same on every rank: rows a worker may hold
    layout, laid = _held_layout(ingested, spec, ranks, shards) if holdable else ("", False)
    if ingested.layout and not laid:
        if ingested.reread is None:
            raise ValueError("rows laid out by an earlier fit need a way to be read again")
        logger.info("rank %d: reading its rows again: not every rank holds its part of their layout", ranks.rank)
        reread = ingested.reread
        ingested.train, ingested.validation, ingested.layout = None, None, ""  # the laid-out rows go first
        try:
            fresh = reread()
        except BaseException:
            held.forget()  # the worker holds nothing rather than rows whose tables are gone
            raise
        ingested.train, ingested.validation = fresh.train, fresh.validation
    schema, columns = spec.schema, spec.columns
    tables = (ingested.train, ingested.validation)
    names = [f"featuresCol {c.name!r}" if schema.layout == FEATURES_LAYOUT else f"inputCols column {c.name!r}"
             for c in schema.columns] + [f"labelCol {columns.label!r}", f"weightCol {columns.weight!r}"]
    width = len(schema.columns) + 1 + (columns.weight is not None)
    info = ranks.all_reduce(_local_layouts(tables, width, ranks), dist.ReduceOp.SUM)
    agreed = [agree(info[:, :, 2 + c * LAYOUT_SIZE:2 + (c + 1) * LAYOUT_SIZE].reshape(-1, LAYOUT_SIZE), names[c],
                    may_be_ragged=schema.layout != FEATURES_LAYOUT and c < len(schema.columns))
              for c in range(width)]
    dtypes = [TORCH_DTYPES[c.dtype] for c in schema.columns]
    dtypes += [torch.int64 if agreed[len(schema.columns)].integer else torch.float32, torch.float32]

    def conformed(table: Table | None) -> Table:
        rows = table.columns() if table is not None else [None] * width
        done = [conform(r, a, d, schema.padding_value) for r, a, d in zip(rows, agreed, dtypes)]
        count = len(schema.columns)
        return Table(done[:count], done[count], done[count + 1] if columns.weight is not None else None)

    train, validation = conformed(tables[0]), conformed(tables[1])
    del tables
    for column, rows in zip(schema.columns, train.inputs):
        if column.shape is not None:
            if rows.row_shape is None:
                raise InputDataError(f"inputShapes[{column.name!r}] needs rows of one size, but column "
                                     f"{column.name!r} holds arrays of different lengths")
            column.check_row_size(math.prod(rows.row_shape))
    counts = [int(n) for n in info[:, 0, 0]]
    _check_enough(counts)
    shard_batch = -(-spec.global_rows_per_step // shards)
    if laid:
        logger.info("rank %d: training on rows this worker holds laid out from an earlier fit", ranks.rank)
        canonical = CanonicalRows(train, counts, shard_batch, spec.seed, ranks, spec.memory_budget,
                                  slots=ingested.slots)
    else:
        ingested.layout, ingested.slots = _LAYING_OUT, None  # held rows a failed layout left are read again
        canonical = _lay_out(train, counts, ingested.row_ids, spec, ranks, shards, shard_batch)
    ingested.train, ingested.slots = canonical.table, canonical.slots
    ingested.layout = layout if ingested.source else ""
    canonical.moved = lambda table: setattr(ingested, "train", table)  # rows moved for an epoch on W != L ranks
    return AgreedRows(canonical, validation, int(info[:, 1, 0].sum()))


def _lay_out(train: Table, counts: list[int], row_ids: torch.Tensor | None, spec: TaskSpec, ranks: Ranks,
             shards: int, shard_batch: int) -> CanonicalRows:
    """Collective: the training rows placed in the run's logical shards, by how they came."""
    if spec.source is not None:  # a table's files read directly come in their order
        return by_source_order(train, counts, shards, shard_batch, spec.seed, ranks, spec.memory_budget)
    if spec.ordered:  # rows through Spark in an order every launch reproduces
        return by_partition_order(train, counts, row_ids, shards, shard_batch, spec.seed, ranks, spec.memory_budget)
    logger.debug("rank %d: laying %s training rows per rank out in %d logical shards", ranks.rank, counts, shards)
    return to_canonical(train, counts, shards, shard_batch, spec.seed, ranks, spec.memory_budget)


def _held_layout(ingested: IngestedRows, spec: TaskSpec, ranks: Ranks, shards: int) -> tuple[str, bool]:
    """Collective: the layout of this fit's rows (from every rank's source, how the rows are
    placed, the ranks and the shards; ``"moved"`` on another number of ranks than shards,
    which a later fit never reuses), and whether every rank holds its part of it already."""
    digests = ranks.counts(torch.tensor([_digest(ingested.source), _digest(ingested.layout)], dtype=torch.int64))
    if ranks.world_size != shards or not bool((digests[:, 0] != 0).all()):
        return "moved", False
    placed = "files" if spec.source is not None else "partitions" if spec.ordered else "hash"
    layout = f"layout/{placed}/{ranks.world_size}/{shards}/" + ",".join(str(int(d)) for d in digests[:, 0])
    return layout, bool((digests[:, 1] == _digest(layout)).all())


def _digest(text: str) -> int:
    """64 bits of ``text``'s SHA-256 as an int64, 0 only for ``""``."""
    if not text:
        return 0
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True) or 1


def _local_layouts(tables: tuple[Table | None, Table | None], width: int, ranks: Ranks) -> torch.Tensor:
    """This rank's row counts and column layouts, in its own row of a tensor of every rank's
    (zeros elsewhere, for the all-reduce that fills them in)."""
    info = torch.zeros(ranks.world_size, 2, 2 + width * LAYOUT_SIZE, dtype=torch.int64)
    for role, table in enumerate(tables):
        info[ranks.rank, role, 0] = len(table) if table is not None else 0
        for c, rows in enumerate(table.columns() if table is not None else [None] * width):
            info[ranks.rank, role, 2 + c * LAYOUT_SIZE:2 + (c + 1) * LAYOUT_SIZE] = torch.tensor(layout(rows))
    return info


def _check_enough(counts: list[int]) -> None:
    """Raises:
        InputDataError: Fewer training rows than ranks, so a rank would hold none.
    """
    total, world = sum(counts), len(counts)
    if total < world:
        empty = list(range(total, world))
        raise InputDataError(
            f"rank(s) {empty} received no training rows (rows per rank: {counts}); "
            "give the DataFrame at least numWorkers training rows, or lower numWorkers"
        )


#: Values describing one column on one rank (see :func:`layout`).
LAYOUT_SIZE = 8
_LAYING_OUT = "laying out"  # the layout of held rows while a fit lays them out: none a later fit uses
_MAX_DIMS = LAYOUT_SIZE - 4


def layout(rows: Column | None) -> list[int]:
    """``[has rows, ragged, integer dtype, row dims, dim 1, ...]`` of a rank's column, to
    share with the other ranks."""
    if rows is None or len(rows) == 0:
        return [0] * LAYOUT_SIZE
    integer = int(not rows.dtype.is_floating_point)
    if rows.row_shape is None:
        return [1, 1, integer, 1] + [0] * _MAX_DIMS
    shape = list(rows.row_shape)
    if len(shape) > _MAX_DIMS:
        raise InputDataError(f"rows of {len(shape)} dimensions are not supported (at most {_MAX_DIMS})")
    return [1, 0, integer, len(shape)] + shape + [0] * (_MAX_DIMS - len(shape))


@dataclass(frozen=True)
class Agreed:
    """The layout every rank gives one column.

    Attributes:
        row_shape: The shape of a row, or None for arrays padded per batch.
        integer: Whether the column holds integers (for a label, class indices).
    """

    row_shape: tuple[int, ...] | None
    integer: bool


def agree(layouts: torch.Tensor, what: str, may_be_ragged: bool) -> Agreed:
    """The one layout for a column from every rank's :func:`layout` (rows of ``layouts``).

    Raises:
        InputDataError: Ranks hold rows of different shapes that cannot be padded.
    """
    present = [[int(v) for v in row] for row in layouts if int(row[0])]
    if not present:
        return Agreed((), False)
    integer = any(row[2] for row in present)
    shapes = {tuple(row[4:4 + row[3]]) if not row[1] else None for row in present}
    if may_be_ragged and all(shape is None or len(shape) == 1 for shape in shapes):
        return Agreed(None if len(shapes) > 1 or None in shapes else shapes.pop(), integer)
    if None in shapes:
        raise InputDataError(f"{what} holds arrays of different lengths; every row needs the same length")
    if len(shapes) == 1:
        return Agreed(shapes.pop(), integer)
    sizes = sorted(shape for shape in shapes if shape is not None)  # None was refused above
    raise InputDataError(
        f"{what} holds rows of {_size(sizes[0])} values in some partitions and of {_size(sizes[-1])} in others; "
        "every row needs the same number of values"
    )


def _size(shape: tuple[int, ...]) -> str:
    return str(shape[0]) if len(shape) == 1 else str(list(shape)) if shape else "1"


def conform(rows: Column | None, agreed: Agreed, dtype: torch.dtype, padding: float) -> Column:
    """``rows`` in the agreed layout (no rows: an empty column of it)."""
    if rows is None or len(rows) == 0:
        if agreed.row_shape is None:
            return RaggedColumn(DenseColumn(torch.empty(0, dtype=dtype)), torch.zeros(1, dtype=torch.int64), padding)
        return DenseColumn(torch.empty(0, *agreed.row_shape, dtype=dtype))
    if agreed.row_shape is None and not isinstance(rows, RaggedColumn):
        return rows.to_ragged(padding)
    return rows


def shape_labels(labels: torch.Tensor, output_shape: list[int], label_name: str,
                 as_read: bool = False) -> torch.Tensor:
    """Gives labels the shape the loss expects beside the model's output, never by
    broadcasting: integer labels of a one-output model become float32 regression targets
    shaped like the output, integer labels of a k-output model stay int64 class indices,
    as do whole-number float labels (Spark ML's indexers give doubles: 0.0, 1.0, ...),
    float labels take the output's shape when they hold as many values per row.

    Args:
        labels: One batch's or one table's labels, as read from the column.
        output_shape: The model's output shape per row.
        label_name: ``labelCol``, for messages.
        as_read: A callable loss: labels of another width than the output are the loss's
            business and come as the column holds them (a weight beside a target, say).

    Raises:
        InputDataError: The labels cannot match the output without broadcasting, or one
            number per row for a k-output model is not a whole number.
    """
    per_row, width = list(labels.shape[1:]), math.prod(output_shape)
    if as_read and per_row and math.prod(per_row) != width:
        return labels
    if labels.is_floating_point() and width > 1 and labels.dim() == 1:
        return _class_indices(labels, output_shape, label_name)
    if not labels.is_floating_point():
        if width > 1 and labels.dim() == 1:
            return labels  # class indices
        labels = labels.float()
    if per_row == list(output_shape):
        return labels
    if math.prod(per_row) == width:
        return labels.reshape(len(labels), *output_shape)
    per_row_text = f"{math.prod(per_row)} values" if per_row else "one number"
    raise InputDataError(
        f"the model returns {output_shape} values per row but labelCol {label_name!r} holds {per_row_text} per row; "
        "make the model's output match the label, or the label the output"
    )


def _class_indices(labels: torch.Tensor, output_shape: list[int], label_name: str) -> torch.Tensor:
    """Float labels, one per row, of a model with several outputs: class indices when
    every one is a whole number (as integer labels are).

    Raises:
        InputDataError: A label has a fraction (or is negative, NaN or infinite).
    """
    whole = torch.isfinite(labels) & (labels >= 0) & (labels == torch.round(labels))
    if bool(whole.all()):
        return labels.long()
    bad = float(labels[~whole][0])
    raise InputDataError(
        f"labelCol {label_name!r} holds {bad:g}, but the model returns {output_shape} values per row, so it takes "
        f"one class index per row (a whole number from 0 to {math.prod(output_shape) - 1}, as StringIndexer gives) "
        "or as many values per row as it returns (an array or Vector label); index or round the label, or give "
        "the model one output per row for regression"
    )
