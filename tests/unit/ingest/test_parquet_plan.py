"""Which Parquet column types the tasks read themselves when scoring: exactly the Arrow
data Spark would pass to Python, nothing that Spark's reader would turn into other values."""

import pyarrow as pa
import pytest
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import types as T

from spark_torch_est.ingest.parquet_plan import _arrow_type, scoring_parts
from spark_torch_est.ingest.spark_types import arrow_name as _spark_type

_VECTOR_IN_PARQUET = pa.struct([pa.field("type", pa.int8(), nullable=False), ("size", pa.int32()),
                                ("indices", pa.list_(pa.field("element", pa.int32()))),
                                ("values", pa.list_(pa.field("element", pa.float64())))])


@pytest.mark.parametrize("spark_type, arrow_type", [
    (T.ByteType(), pa.int8()), (T.ShortType(), pa.int16()), (T.IntegerType(), pa.int32()),
    (T.LongType(), pa.int64()), (T.FloatType(), pa.float32()), (T.DoubleType(), pa.float64()),
    (T.BooleanType(), pa.bool_()), (T.StringType(), pa.string()), (T.BinaryType(), pa.binary()),
    (T.ArrayType(T.ArrayType(T.FloatType())), pa.list_(pa.list_(pa.field("element", pa.float32())))),
    (VectorUDT(), _VECTOR_IN_PARQUET),
])
def test_types_read_as_spark_passes_them_match(spark_type, arrow_type):
    assert _spark_type(spark_type) is not None and _spark_type(spark_type) == _arrow_type(arrow_type)


@pytest.mark.parametrize("spark_type", [T.DecimalType(10, 3), T.DateType(), T.TimestampType(), T.TimestampNTZType(),
                                        T.MapType(T.StringType(), T.IntegerType()), T.ArrayType(T.DateType()),
                                        T.StructType([T.StructField("at", T.TimestampType())])])
def test_types_spark_reads_its_own_way_are_left_to_spark(spark_type):
    assert _spark_type(spark_type) is None


@pytest.mark.parametrize("spark_type, arrow_type", [
    (T.ShortType(), pa.uint8()), (T.StringType(), pa.large_string()), (T.BinaryType(), pa.large_binary()),
    (T.ArrayType(T.FloatType()), pa.list_(pa.float64())), (T.ArrayType(T.FloatType()), pa.list_(pa.float32(), 4)),
    (T.IntegerType(), pa.int64()),
])
def test_files_holding_other_arrow_types_do_not_match(spark_type, arrow_type):
    assert _spark_type(spark_type) != _arrow_type(arrow_type)


MB = 2 ** 20


@pytest.mark.parametrize("size, rows, slots, parts", [
    (25 * MB, 200_000, 2, 2),          # spread over the cores
    (520 * MB, 4_000_000, 2, 6),       # 128 MB parts, whole waves of 2
    (25 * MB, 200_000, 1000, 7),       # 4 MB parts at least: not 1000 tasks for 25 MB
    (1000, 3, 2, 1),                   # a tiny table: one task
    (0, 0, 8, 1),                      # an empty table: one empty part
    (64 * MB, 5, 4, 4),                # never more parts than rows
])
def test_scoring_parts_are_sized_as_spark_sizes_its_splits(size, rows, slots, parts):
    assert scoring_parts(size, rows, slots) == parts
