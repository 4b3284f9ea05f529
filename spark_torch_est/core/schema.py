"""[both] What the model reads: each input column's tensor type and row shape.

The driver derives an :class:`InputSchema` from the DataFrame's schema and the Params
(``featuresCol`` / ``featureCols`` / ``inputCols``, ``inputShapes``); the ranks turn
Arrow columns into tensors by it; the checkpoint records it, and ``transform`` and
``evaluate`` check a DataFrame against it. Plain data only, so it pickles and serializes
as JSON.

=====================================  =================================================
Spark column                           tensor per batch
=====================================  =================================================
byte / short / int / long              int64 ``(B,)``: ids stay exact
float / double / decimal               float32 ``(B,)``
boolean                                bool ``(B,)``
array<int / long>                      int64 ``(B, L)``
array<float / double>, Vector          float32 ``(B, L)``
array<array<...>> of fixed sizes       ``(B, L1, L2, ...)``
binary                                 uint8 ``(B, L)`` (raw bytes)
arrays of different lengths            padded per batch to its longest row
=====================================  =================================================

:meth:`InputSchema.model_inputs` is the one adapter from a batch's column tensors to the
model's arguments, used alike by training, ``transform``, ``evaluate`` and ``predict_udf``;
:func:`call_model` calls the model with them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from spark_torch_est.errors import InvalidInputError

if TYPE_CHECKING:
    from torch import Tensor

    #: What the model is called with: one tensor (``model(x)``) or a tuple (``model(*x)``).
    ModelInputs = Tensor | tuple[Tensor, ...]

__all__ = ["InputColumn", "InputSchema", "FEATURES_LAYOUT", "INPUTS_LAYOUT", "call_model"]

FEATURES_LAYOUT = "features"  # featuresCol / featureCols: one float32 tensor, model(features)
INPUTS_LAYOUT = "inputs"      # inputCols: a tuple of typed tensors, model(*inputs)
_DTYPES = ("int64", "float32", "bool", "uint8")


@dataclass(frozen=True)
class InputColumn:
    """One input of the model.

    Attributes:
        name: The user's column (for ``featureCols``, the columns joined by ``", "``).
        dtype: The tensor's dtype: ``"int64"``, ``"float32"``, ``"bool"`` or ``"uint8"``.
        depth: Array nesting of a row: 0 for a number, 1 for an array, Vector or binary,
            2 for an array of arrays, ...
        spark_type: The column's Spark type (``DataType.simpleString()``), for messages.
        shape: The row shape to reshape each row to (``inputShapes``), or None.
    """

    name: str
    dtype: str
    depth: int
    spark_type: str
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown input dtype {self.dtype!r}")
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    def check_row_size(self, size: int) -> None:
        """Raises InvalidInputError unless a row of ``size`` values fits ``shape``.

        Raises:
            InvalidInputError: ``inputShapes`` asks for another number of values.
        """
        if self.shape is not None and math.prod(self.shape) != size:
            raise InvalidInputError(
                f"inputShapes[{self.name!r}]={list(self.shape)} needs {math.prod(self.shape)} values per row, but "
                f"column {self.name!r} ({self.spark_type}) has {size}; fix inputShapes or the column"
            )


@dataclass(frozen=True)
class InputSchema:
    """The model's inputs, in call order.

    Attributes:
        layout: :data:`FEATURES_LAYOUT` (one float32 tensor, the model is called as
            ``model(features)``) or :data:`INPUTS_LAYOUT` (``model(*inputs)``).
        columns: One entry per input.
        padding_value: What ragged arrays are padded with.
    """

    layout: str
    columns: tuple[InputColumn, ...]
    padding_value: float = 0.0

    @property
    def names(self) -> list[str]:
        """The columns' names."""
        return [column.name for column in self.columns]

    def model_inputs(self, tensors: Sequence[Tensor]) -> ModelInputs:
        """A batch's column tensors (one per column, in order) as the model takes them:
        each reshaped by its ``inputShapes`` row shape; the one tensor under
        :data:`FEATURES_LAYOUT`, the tuple under :data:`INPUTS_LAYOUT` (see :func:`call_model`)."""
        shaped = tuple(x.reshape(len(x), *column.shape) if column.shape is not None else x
                       for x, column in zip(tensors, self.columns))
        return shaped[0] if self.layout == FEATURES_LAYOUT else shaped

    def describe(self, tensors: Sequence[Tensor], feature_cols: Sequence[str] | None = None) -> str:
        """What the model was given (the column tensors of a batch), in the user's column
        names; ``feature_cols`` are the ``featureCols`` behind the one features input."""
        if self.layout == FEATURES_LAYOUT:
            width = math.prod(tensors[0].shape[1:])
            source = f"featureCols {list(feature_cols)}" if feature_cols else f"featuresCol {self.columns[0].name!r}"
            return (f"the model was given {width} features per row ({source}): "
                    f"a batch of shape {tuple(tensors[0].shape)}")
        given = ", ".join(f"{c.name!r}: {str(t.dtype).replace('torch.', '')} {tuple(t.shape)}"
                          for c, t in zip(self.columns, tensors))
        return f"the model was called as model(*inputs) with inputCols {given}"

    def to_dict(self) -> dict:
        """Plain data for the checkpoint."""
        return {"layout": self.layout, "padding_value": self.padding_value,
                "columns": [{**asdict(c), "shape": list(c.shape) if c.shape is not None else None}
                            for c in self.columns]}

    @classmethod
    def from_dict(cls, data: dict) -> InputSchema:
        """Inverse of :meth:`to_dict`."""
        return cls(layout=data["layout"], padding_value=float(data["padding_value"]),
                   columns=tuple(InputColumn(**c) for c in data["columns"]))


def call_model(model: Callable[..., Any], inputs: ModelInputs) -> Any:
    """The model on :meth:`InputSchema.model_inputs`: ``model(*inputs)`` for a tuple,
    else ``model(inputs)``."""
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)
