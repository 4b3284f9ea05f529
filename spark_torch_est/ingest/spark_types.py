"""[driver] Spark's column types, classified once: which tensor dtype a column of each
atomic type becomes, and which Arrow type pyarrow reads it as from Parquet (so a table
read directly is checked against the DataFrame's schema).
"""

from __future__ import annotations

from pyspark.sql import types as T

__all__ = ["tensor_dtype", "is_numeric", "arrow_name", "ARROW_NAMES"]

#: Atomic Spark type -> (the tensor dtype its values become, the Arrow type pyarrow reads
#: it as from Parquet); None where there is none (strings become no tensor, decimals are read
#: through Spark).
_ATOMS: dict[type, tuple[str | None, str | None]] = {
    T.ByteType: ("int64", "int8"), T.ShortType: ("int64", "int16"), T.IntegerType: ("int64", "int32"),
    T.LongType: ("int64", "int64"), T.FloatType: ("float32", "float"), T.DoubleType: ("float32", "double"),
    T.DecimalType: ("float32", None), T.BooleanType: ("bool", "bool"), T.StringType: (None, "string"),
    T.BinaryType: ("uint8", "binary"),  # one row's bytes: a uint8 array
}
ARROW_NAMES = frozenset(arrow for _, arrow in _ATOMS.values() if arrow is not None)


def tensor_dtype(data_type: T.DataType) -> str | None:
    """The tensor dtype a column of the atomic ``data_type`` becomes (``"int64"``,
    ``"float32"``, ``"bool"``, ``"uint8"`` for bytes), or None."""
    return _ATOMS.get(type(data_type), (None, None))[0]


def is_numeric(data_type: T.DataType) -> bool:
    """Integers, floating point, decimals and booleans: what a float feature or label can be."""
    return tensor_dtype(data_type) in ("int64", "float32", "bool")


def arrow_name(data_type: T.DataType) -> object:
    """``data_type`` as a comparable value of Arrow type names (``("array", "float")``,
    ``("struct", ((name, type), ...))``); None for types a direct read does not take as they are."""
    if isinstance(data_type, T.UserDefinedType):
        return arrow_name(data_type.sqlType())
    if isinstance(data_type, T.ArrayType):
        element = arrow_name(data_type.elementType)
        return None if element is None else ("array", element)
    if isinstance(data_type, T.StructType):
        members = tuple((f.name, arrow_name(f.dataType)) for f in data_type.fields)
        return None if any(t is None for _, t in members) else ("struct", members)
    return _ATOMS.get(type(data_type), (None, None))[1]
