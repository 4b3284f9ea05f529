"""Checks of a DataFrame's schema (no Spark session needed)."""

import pytest
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import types as T

from spark_torch_est.errors import InvalidInputError
from spark_torch_est.ingest.frames import check_validation_col, features_kind, label_kind

SCHEMA = T.StructType([
    T.StructField("vec", VectorUDT()), T.StructField("arr", T.ArrayType(T.DoubleType())),
    T.StructField("x", T.DoubleType()), T.StructField("n", T.IntegerType()),
    T.StructField("name", T.StringType()), T.StructField("flag", T.BooleanType()),
    T.StructField("words", T.ArrayType(T.StringType())),
])


def test_feature_layouts_are_recognized():
    assert features_kind(SCHEMA, "vec", None) == "vector"
    assert features_kind(SCHEMA, "arr", None) == "array"
    assert features_kind(SCHEMA, "x", None) == "scalar"
    assert features_kind(SCHEMA, None, ["x", "n", "flag"]) == "columns"


@pytest.mark.parametrize("features_col, feature_cols, message", [
    ("missing", None, "featuresCol='missing': no such column; the DataFrame has vec, arr"),
    ("name", None, "featuresCol='name' has type string"),
    ("words", None, "array<string>"),
    (None, ["x", "name"], "featureCols: column 'name' has type string"),
    (None, [], "empty list"),
    (None, None, "set featuresCol"),
])
def test_bad_feature_columns_are_explained(features_col, feature_cols, message):
    with pytest.raises(InvalidInputError, match=message.replace("(", "\\(").replace(")", "\\)")):
        features_kind(SCHEMA, features_col, feature_cols)


def test_label_kinds_and_errors():
    assert label_kind(SCHEMA, "n") == "long"
    assert label_kind(SCHEMA, "x") == "float"
    assert label_kind(SCHEMA, "arr") == "array"
    with pytest.raises(InvalidInputError, match="labelCol='name'"):
        label_kind(SCHEMA, "name")
    with pytest.raises(InvalidInputError, match="labelCol='y': no such column"):
        label_kind(SCHEMA, "y")
    with pytest.raises(InvalidInputError, match="must be boolean"):
        check_validation_col(SCHEMA, "x")
