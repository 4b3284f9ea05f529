"""[driver] Checks a DataFrame's columns and reduces them, in the JVM, to the three columns
the tasks read (see :mod:`spark_torch_est.ingest.tables`).

The checks work on the schema alone (no SparkSession needed); only building the column
expressions touches Spark.
"""

from __future__ import annotations

import functools
import math

from pyspark.ml.linalg import VectorUDT
from pyspark.sql import Column, DataFrame
from pyspark.sql import types as T

from spark_torch_est.core import jvm
from spark_torch_est.core.protocol import FEATURES, IS_VALIDATION, LABEL, ROW_ID, WEIGHT, input_column
from spark_torch_est.core.schema import FEATURES_LAYOUT, INPUTS_LAYOUT, InputColumn, InputSchema
from spark_torch_est.core.spec import How
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.ingest.spark_types import is_numeric, tensor_dtype

__all__ = ["features_kind", "label_kind", "check_validation_col", "feature_column", "label_column",
           "input_schema", "check_inputs", "weight_column", "training_columns", "training_frame", "staging_frame",
           "frame_outputs"]

ROW_ORDER = "__ste_row_order"
_PARTITION_KEY = "__ste_partition_key"  # the hash partitioning's key of a row's residue (see _by_position)
_MASK32 = (1 << 32) - 1


def _field(schema: T.StructType, name: str, param: str) -> T.DataType:
    if name not in schema.names:
        raise InvalidInputError(
            f"{param}={name!r}: no such column; the DataFrame has {', '.join(schema.names) or 'no columns'}"
        )
    return schema[name].dataType


def _value_kind(data_type: T.DataType, name: str, param: str) -> str:
    if isinstance(data_type, VectorUDT):
        return "vector"
    if isinstance(data_type, T.ArrayType) and is_numeric(data_type.elementType):
        return "array"
    if is_numeric(data_type):
        return "scalar"
    raise InvalidInputError(
        f"{param}={name!r} has type {data_type.simpleString()}; use a Vector, an array of numbers or a numeric column"
    )


def features_kind(schema: T.StructType, features_col: str | None, feature_cols: list[str] | None) -> str:
    """How the features are laid out: ``"columns"`` (featureCols), ``"vector"``, ``"array"``
    or ``"scalar"`` (one numeric featuresCol).

    Raises:
        InvalidInputError: A column is missing or not numeric, or neither Param is usable.
    """
    if feature_cols:
        for name in feature_cols:
            data_type = _field(schema, name, "featureCols")
            if not is_numeric(data_type):
                raise InvalidInputError(
                    f"featureCols: column {name!r} has type {data_type.simpleString()}, not a number; "
                    "put vectors or arrays in featuresCol instead"
                )
        return "columns"
    if feature_cols is not None:
        raise InvalidInputError("featureCols is an empty list; name at least one column or use featuresCol")
    if not features_col:
        raise InvalidInputError("set featuresCol (a Vector or array column) or featureCols (numeric columns)")
    return _value_kind(_field(schema, features_col, "featuresCol"), features_col, "featuresCol")


def _feature_names(features_col: str | None, feature_cols: list[str] | None) -> list[str]:
    """The columns the features come from, as :func:`features_kind` accepted them:
    featureCols, else featuresCol alone."""
    if feature_cols:
        return feature_cols
    if not features_col:  # features_kind refused this already
        raise InvalidInputError("set featuresCol (a Vector or array column) or featureCols (numeric columns)")
    return [features_col]


def label_kind(schema: T.StructType, label_col: str) -> str:
    """``"long"`` (class indices), ``"float"`` (regression) or a vector/array kind.

    Raises:
        InvalidInputError: The column is missing or of an unusable type.
    """
    data_type = _field(schema, label_col, "labelCol")
    kind = tensor_dtype(data_type)
    if kind == "int64":
        return "long"
    if kind in ("float32", "bool"):
        return "float"
    return _value_kind(data_type, label_col, "labelCol")


def check_validation_col(schema: T.StructType, name: str) -> None:
    """Raises InvalidInputError unless ``name`` is a boolean column."""
    data_type = _field(schema, name, "validationIndicatorCol")
    if not isinstance(data_type, T.BooleanType):
        raise InvalidInputError(
            f"validationIndicatorCol={name!r} has type {data_type.simpleString()}; it must be boolean"
        )


def _as_float_array(name: str, kind: str) -> Column:
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    if kind == "vector":
        return vector_to_array(F.col(name), "float32")
    if kind == "array":
        return F.col(name).cast("array<float>")
    return F.array(F.col(name).cast("float"))


def feature_column(df: DataFrame, features_col: str | None, feature_cols: list[str] | None) -> Column:
    """The features as one ``array<float>`` expression (checked first)."""
    from pyspark.sql import functions as F

    kind = features_kind(df.schema, features_col, feature_cols)
    names = _feature_names(features_col, feature_cols)
    if kind == "columns":
        return F.array(*[F.col(name).cast("float") for name in names])
    return _as_float_array(names[0], kind)


def label_column(df: DataFrame, label_col: str) -> Column:
    """The label as long (class indices), float, or ``array<float>`` (checked first)."""
    from pyspark.sql import functions as F

    kind = label_kind(df.schema, label_col)
    if kind in ("long", "float"):
        return F.col(label_col).cast(kind)
    return _as_float_array(label_col, kind)


def _input_column(data_type: T.DataType, name: str, shape: list[int] | None) -> InputColumn:
    """How one ``inputCols`` column becomes a tensor (see :mod:`spark_torch_est.core.schema`).

    Raises:
        InvalidInputError: Strings, maps, structs, dates and other types a model cannot take.
    """
    depth, element = 0, data_type
    while isinstance(element, T.ArrayType):
        depth, element = depth + 1, element.elementType
    if isinstance(element, VectorUDT):
        if depth:
            raise InvalidInputError(f"inputCols: column {name!r} has type {data_type.simpleString()}; arrays of "
                                    "Vectors are not supported: turn them into arrays of arrays first "
                                    "(pyspark.ml.functions.vector_to_array)")
        depth, dtype = depth + 1, "float32"
    elif isinstance(element, T.BinaryType):
        depth, dtype = depth + 1, "uint8"
    elif (atom := tensor_dtype(element)) is not None:
        dtype = atom
    else:
        hint = ("tokenize or index it in Spark first (pyspark.ml.feature.StringIndexer, or Tokenizer then "
                "CountVectorizer), or encode it as bytes" if isinstance(element, (T.StringType, T.VarcharType,
                                                                                     T.CharType)) else
                "turn it into numbers in Spark first")
        raise InvalidInputError(f"inputCols: column {name!r} has type {data_type.simpleString()}, which no tensor "
                                f"holds; {hint}")
    column = InputColumn(name, dtype, depth, data_type.simpleString(), tuple(shape) if shape is not None else None)
    if shape is not None and depth == 0:
        column.check_row_size(1)
    return column


def input_schema(schema: T.StructType, *, features_col: str | None, feature_cols: list[str] | None,
                 input_cols: list[str] | None, input_shapes: dict[str, list[int]] | None = None,
                 padding_value: float = 0.0) -> InputSchema:
    """The model's inputs for a DataFrame: ``inputCols`` (typed, several) over
    ``featureCols`` over ``featuresCol`` (one float32 tensor).

    Raises:
        InvalidInputError: A column is missing or of an unusable type, or inputShapes
            names a column that is not an input or asks for a size the type cannot have.
    """
    shapes = dict(input_shapes or {})
    if input_cols:
        unknown = sorted(set(shapes) - set(input_cols))
        if unknown:
            raise InvalidInputError(f"inputShapes names {unknown}, which are not in inputCols={list(input_cols)}")
        for name, shape in shapes.items():
            if not (isinstance(shape, (list, tuple)) and shape and all(isinstance(d, int) and d > 0 for d in shape)):
                raise InvalidInputError(f"inputShapes[{name!r}] must be a list of positive sizes, got {shape!r}")
        if len(set(input_cols)) != len(input_cols):
            raise InvalidInputError(f"inputCols names a column twice: {list(input_cols)}")
        columns = tuple(_input_column(_field(schema, name, "inputCols"), name, shapes.get(name)) for name in input_cols)
        _check_padding(columns, padding_value)
        return InputSchema(INPUTS_LAYOUT, columns, float(padding_value))
    if input_cols is not None:
        raise InvalidInputError("inputCols is an empty list; name at least one column, or use featuresCol")
    if shapes:
        raise InvalidInputError("inputShapes applies to inputCols; set inputCols, or reshape in the model")
    kind = features_kind(schema, features_col, feature_cols)
    names = _feature_names(features_col, feature_cols)
    if kind == "columns":
        name, spark_type = ", ".join(names), "array<float>"
    else:
        name, spark_type = names[0], schema[names[0]].dataType.simpleString()
    return InputSchema(FEATURES_LAYOUT, (InputColumn(name, "float32", 1, spark_type),), float(padding_value))


_INTEGER_RANGES = {"int64": (-2 ** 63, 2 ** 63 - 1), "uint8": (0, 255), "bool": (0, 1)}


def _check_padding(columns: tuple[InputColumn, ...], padding_value: float) -> None:
    """Refuses a ``paddingValue`` that an integer, byte or boolean array column cannot hold."""
    for column in columns:
        bounds = _INTEGER_RANGES.get(column.dtype)
        if bounds is None or column.depth == 0 or column.shape is not None:  # numbers and reshaped rows: never padded
            continue
        value = float(padding_value)
        if not (math.isfinite(value) and value == int(value) and bounds[0] <= int(value) <= bounds[1]):
            raise InvalidInputError(
                f"paddingValue={padding_value!r} cannot pad the {column.dtype} arrays of inputCols column "
                f"{column.name!r} ({column.spark_type}): set a whole number in {bounds[0]}..{bounds[1]}")


def check_inputs(schema: T.StructType, trained: InputSchema, derived: InputSchema) -> None:
    """Checks that a DataFrame's inputs (``derived`` from its schema) match those the
    model was trained on.

    Raises:
        InvalidInputError: Names the column that is missing, added or of another type.
    """
    if derived.layout != trained.layout or len(derived.columns) != len(trained.columns):
        raise InvalidInputError(
            f"the model was trained on {trained.layout} {trained.names}, but the DataFrame would give it "
            f"{derived.layout} {derived.names}; set the model's featuresCol/featureCols/inputCols to match"
        )
    for now, then in zip(derived.columns, trained.columns):
        if (now.dtype, now.depth) != (then.dtype, then.depth):
            raise InvalidInputError(
                f"column {now.name!r} has type {now.spark_type}, but the model was trained on {then.spark_type} "
                f"(column {then.name!r}); cast it back, e.g. df.withColumn({now.name!r}, "
                f"F.col({now.name!r}).cast({then.spark_type!r}))"
            )


def _typed_expression(name: str, column: InputColumn) -> Column:
    """One ``inputCols`` column as the tasks read it: Vectors as float arrays, numbers cast
    to long, float or boolean (in the JVM, where casting is cheap), bytes as they are."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    if column.spark_type == "vector":
        return vector_to_array(F.col(name), "float32")
    if column.dtype == "uint8":
        return F.col(name)
    target = {"int64": "bigint", "float32": "float", "bool": "boolean"}[column.dtype]
    for _ in range(column.depth):
        target = f"array<{target}>"
    return F.col(name).cast(target)


def weight_column(df: DataFrame, weight_col: str) -> Column:
    """The sample weights as float (checked first).

    Raises:
        InvalidInputError: The column is missing or not a number.
    """
    from pyspark.sql import functions as F

    data_type = _field(df.schema, weight_col, "weightCol")
    if tensor_dtype(data_type) not in ("int64", "float32"):
        raise InvalidInputError(f"weightCol={weight_col!r} has type {data_type.simpleString()}; it must be a number")
    return F.col(weight_col).cast("float")


def training_columns(df: DataFrame, *, schema: InputSchema, features_col: str | None, feature_cols: list[str] | None,
                     label_col: str, validation_col: str | None, weight_col: str | None) -> list[Column]:
    """The columns the tasks read, as expressions over ``df`` (checked first).

    Raises:
        InvalidInputError: A column is missing or has an unusable type.
    """
    from pyspark.sql import functions as F

    if schema.layout == FEATURES_LAYOUT:
        columns = [feature_column(df, features_col, feature_cols).alias(FEATURES)]
    else:
        columns = [_typed_expression(c.name, c).alias(input_column(i)) for i, c in enumerate(schema.columns)]
    columns.append(label_column(df, label_col).alias(LABEL))
    if weight_col is not None:
        columns.append(weight_column(df, weight_col).alias(WEIGHT))
    if validation_col is not None:
        check_validation_col(df.schema, validation_col)
        columns.append(F.col(validation_col).alias(IS_VALIDATION))
    return columns


def training_frame(df: DataFrame, columns: list[Column], num_workers: int, partitions: int | None = None) -> DataFrame:
    """``columns`` (see :func:`training_columns`) of ``df`` in ``num_workers`` partitions.

    With ``partitions`` (L, the run's logical shards; see
    :mod:`spark_torch_est.ingest.canonical`) the rows are first cut into L logical partitions
    in an order every job reproduces, as long as the input's order is stable (files, local
    data, a cached DataFrame): the rows dealt out by their positions in the input
    (:func:`_by_position`), each partition sorted by them (a shuffle's output order depends
    on fetch timing). On L ranks
    each task reads one logical partition whole; on others each row carries its place there
    (:data:`~spark_torch_est.core.protocol.ROW_ID`) through one more shuffle into
    ``num_workers`` partitions. Without ``partitions`` (rows the ranks place by hashing)
    the rows are repartitioned into ``num_workers``. Either way the shuffle is skipped when
    the DataFrame already has the partitions asked for (where Spark can tell without
    running a job).
    """
    from pyspark.sql import functions as F

    logical = partitions or num_workers
    if jvm.barrier_partitions(df) == logical:
        frame = df.select(*columns)
    else:
        frame = _by_position(df.select(*columns, F.monotonically_increasing_id().alias(ROW_ORDER)), logical)
    if logical == num_workers:
        return frame
    return frame.withColumn(ROW_ID, F.monotonically_increasing_id()).repartition(num_workers, ROW_ID)


def staging_frame(df: DataFrame, columns: list[Column], num_workers: int, partitions: int | None) -> DataFrame | None:
    """``columns`` of ``df`` in its own partitions, where :func:`training_frame` shuffles
    them into as many logical partitions as ranks, dealt out by their positions: a staging
    job may then write them out for the ranks to read (see
    :mod:`spark_torch_est.ingest.staged`) instead of the shuffle. None otherwise: no
    shuffle, rows placed by hashing, or a run continued on another number of ranks."""
    if partitions is None or partitions != num_workers or jvm.barrier_partitions(df) == partitions:
        return None
    return df.select(*columns)


def _by_position(frame: DataFrame, partitions: int) -> DataFrame:
    """``frame`` in ``partitions`` partitions, its row at position ``o`` (column
    :data:`ROW_ORDER`, which it drops) in partition ``o mod partitions``, each partition
    sorted by ``o``: a round robin over the rows' positions, each partition's rows differing
    by at most one per input partition.

    Spark's own round robin (``repartition(n)``) first sorts every input partition by the
    rows' bytes so that a retried task deals them out alike
    (``spark.sql.execution.sortBeforeRepartition``): the sort took longer than the shuffle (2M
    rows of 32 floats on 2 cores, a cached DataFrame into 2 barrier tasks: 2.7 s against 1.6 s
    for this). The positions make it
    repeatable without one: a hash partitioning by a key per residue, each key chosen so that
    Spark's partitioner, ``pmod(murmur3(key), n)``, sends it to its residue's partition."""
    from pyspark.sql import functions as F

    keys = F.array(*[F.lit(key) for key in _partition_keys(partitions)]).cast("array<bigint>")
    residue = F.pmod(F.col(ROW_ORDER), F.lit(partitions)).cast("int")
    key = F.element_at(keys, residue + 1).alias(_PARTITION_KEY)
    return (frame.select("*", key).repartition(partitions, _PARTITION_KEY).sortWithinPartitions(ROW_ORDER)
            .drop(_PARTITION_KEY, ROW_ORDER))


@functools.lru_cache(maxsize=64)
def _partition_keys(partitions: int) -> tuple[int, ...]:
    """The smallest non-negative longs ``k_j`` with ``pmod(murmur3(k_j), partitions) == j``
    for each ``j``: the partition Spark's hash partitioning gives a row keyed ``k_j``."""
    keys: dict[int, int] = {}
    candidate = 0
    while len(keys) < partitions:
        keys.setdefault(spark_hash_long(candidate) % partitions, candidate)
        candidate += 1
    return tuple(keys[j] for j in range(partitions))


def spark_hash_long(value: int, seed: int = 42) -> int:
    """Spark's ``hash()`` of one long (``Murmur3_x86_32.hashLong``, the seed Spark's hash
    partitioning and ``functions.hash`` use), as a signed 32-bit int."""
    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & _MASK32

    def mix(h: int, k: int) -> int:
        k = rotl((k * 0xCC9E2D51) & _MASK32, 15) * 0x1B873593 & _MASK32
        return (rotl(h ^ k, 13) * 5 + 0xE6546B64) & _MASK32

    value &= (1 << 64) - 1
    h = mix(mix(seed & _MASK32, value & _MASK32), value >> 32) ^ 8
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _MASK32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _MASK32
    h ^= h >> 16
    return h - (1 << 32) if h >= 1 << 31 else h


def frame_outputs(df: DataFrame, *, schema: InputSchema, features_col: str | None, feature_cols: list[str] | None,
                  label_col: str, validation_col: str | None,
                  weight_col: str | None) -> list[tuple[str, tuple[str, ...], How]]:
    """The training frame's columns as the ranks build them from a table's own columns
    when they read its files (see :class:`spec.FileSource`): what :func:`training_columns`
    computes in the JVM, but done per batch in the tasks."""
    if schema.layout == FEATURES_LAYOUT:
        kind = features_kind(df.schema, features_col, feature_cols)
        how = How.STACK if kind == "columns" else How.WRAP if kind == "scalar" else How.AS_IS
        outputs = [(FEATURES, tuple(_feature_names(features_col, feature_cols)), how)]
    else:
        outputs = [(input_column(i), (c.name,), How.AS_IS) for i, c in enumerate(schema.columns)]
    outputs.append((LABEL, (label_col,), How.AS_IS))
    if weight_col is not None:
        outputs.append((WEIGHT, (weight_col,), How.AS_IS))
    if validation_col is not None:
        outputs.append((IS_VALIDATION, (validation_col,), How.AS_IS))
    return outputs
