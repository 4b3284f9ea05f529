"""[driver] Checks a DataFrame's columns and reduces them, in the JVM, to the three columns
the tasks read (see :mod:`spark_torch_est.data`)."""

from __future__ import annotations

from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from spark_torch_est.data import FEATURES, IS_VALIDATION, LABEL
from spark_torch_est.errors import InvalidInputError

__all__ = ["feature_column", "label_column", "training_frame"]

_INTEGRAL = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)
_FRACTIONAL = (T.FloatType, T.DoubleType, T.DecimalType)


def _field(df: DataFrame, name: str, param: str) -> T.StructField:
    if name not in df.columns:
        raise InvalidInputError(
            f"{param}={name!r}: no such column; the DataFrame has {', '.join(df.columns) or 'no columns'}"
        )
    return df.schema[name]


def _is_numeric(data_type: T.DataType) -> bool:
    return isinstance(data_type, _INTEGRAL + _FRACTIONAL + (T.BooleanType,))


def _as_float_array(df: DataFrame, name: str, param: str) -> Column:
    data_type = _field(df, name, param).dataType
    if isinstance(data_type, VectorUDT):
        return vector_to_array(F.col(name), "float32")
    if isinstance(data_type, T.ArrayType) and _is_numeric(data_type.elementType):
        return F.col(name).cast("array<float>")
    if _is_numeric(data_type):
        return F.array(F.col(name).cast("float"))
    raise InvalidInputError(
        f"{param}={name!r} has type {data_type.simpleString()}; use a Vector, an array of numbers "
        "or a numeric column"
    )


def feature_column(df: DataFrame, features_col: str | None, feature_cols: list[str] | None) -> Column:
    """The features as one ``array<float>`` expression.

    Raises:
        InvalidInputError: A column is missing or not numeric, or neither Param is usable.
    """
    if feature_cols:
        for name in feature_cols:
            data_type = _field(df, name, "featureCols").dataType
            if not _is_numeric(data_type):
                raise InvalidInputError(
                    f"featureCols: column {name!r} has type {data_type.simpleString()}, not a number; "
                    "put vectors or arrays in featuresCol instead"
                )
        return F.array(*[F.col(name).cast("float") for name in feature_cols])
    if feature_cols is not None:
        raise InvalidInputError("featureCols is an empty list; name at least one column or use featuresCol")
    if not features_col:
        raise InvalidInputError("set featuresCol (a Vector or array column) or featureCols (numeric columns)")
    return _as_float_array(df, features_col, "featuresCol")


def label_column(df: DataFrame, label_col: str) -> Column:
    """The label as float (regression), long (class indices) or ``array<float>``.

    Raises:
        InvalidInputError: The column is missing or of an unusable type.
    """
    data_type = _field(df, label_col, "labelCol").dataType
    if isinstance(data_type, _INTEGRAL):
        return F.col(label_col).cast("long")
    if isinstance(data_type, _FRACTIONAL + (T.BooleanType,)):
        return F.col(label_col).cast("float")
    return _as_float_array(df, label_col, "labelCol")


def training_frame(df: DataFrame, *, features_col: str | None, feature_cols: list[str] | None,
                   label_col: str, validation_col: str | None, num_workers: int) -> DataFrame:
    """The columns the tasks read, in ``num_workers`` partitions.

    The shuffle is skipped when the DataFrame already has exactly ``num_workers``
    partitions (where Spark can tell without running a job).

    Raises:
        InvalidInputError: A column is missing or has an unusable type.
    """
    columns = [
        feature_column(df, features_col, feature_cols).alias(FEATURES),
        label_column(df, label_col).alias(LABEL),
    ]
    if validation_col is not None:
        data_type = _field(df, validation_col, "validationIndicatorCol").dataType
        if not isinstance(data_type, T.BooleanType):
            raise InvalidInputError(
                f"validationIndicatorCol={validation_col!r} has type {data_type.simpleString()}; it must be boolean"
            )
        columns.append(F.col(validation_col).alias(IS_VALIDATION))
    selected = df.select(*columns)
    if _partitions(df) == num_workers:
        return selected
    return selected.repartition(num_workers)


def _partitions(df: DataFrame) -> int | None:
    try:
        return df.rdd.getNumPartitions()
    except Exception:  # Spark Connect has no RDD API; then always repartition
        return None
