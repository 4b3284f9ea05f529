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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from spark_torch_est.errors import InvalidInputError

__all__ = ["InputColumn", "InputSchema", "FEATURES_LAYOUT", "INPUTS_LAYOUT"]

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
