"""Arrow batches to typed columns and label shapes."""

import decimal

import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_torch_est.core.protocol import FEATURES, IS_VALIDATION, LABEL, WEIGHT, input_column
from spark_torch_est.core.schema import INPUTS_LAYOUT, InputColumn, InputSchema
from spark_torch_est.core.spec import ColumnNames
from spark_torch_est.errors import InputDataError
from spark_torch_est.ingest.columns import DenseColumn, RaggedColumn
from spark_torch_est.ingest.tables import (
    arrow_values,
    list_column_to_matrix,
    read_rows,
    stack_columns,
    vectors_to_matrix,
)
from tests.helpers import features_schema


def _batch(features, labels, flags=None):
    arrays = [pa.array(features, pa.list_(pa.float32())), pa.array(labels)]
    names = [FEATURES, LABEL]
    if flags is not None:
        arrays.append(pa.array(flags))
        names.append(IS_VALIDATION)
    return pa.RecordBatch.from_arrays(arrays, names)


def test_list_column_becomes_matrix_also_when_sliced():
    array = pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.float32()))
    np.testing.assert_array_equal(list_column_to_matrix(array.slice(1), "f"), [[3, 4], [5, 6]])


def test_numeric_columns_stack_side_by_side_as_float32_and_nulls_name_their_column():
    stacked = stack_columns([pa.array([1, 2], pa.int64()), pa.array([0.5, 1.5])], ["a", "b"])
    assert stacked.dtype == np.float32 and stacked.tolist() == [[1.0, 0.5], [2.0, 1.5]]
    with pytest.raises(InputDataError, match="'b'"):
        stack_columns([pa.array([1.0]), pa.array([None], pa.float64())], ["a", "b"])


def test_null_rows_and_elements_are_rejected():
    with pytest.raises(InputDataError, match="1 null rows"):
        list_column_to_matrix(pa.array([[1.0], None]), "f")
    with pytest.raises(InputDataError, match="1 null elements"):
        list_column_to_matrix(pa.array([[1.0], [None]]), "f")


@pytest.mark.parametrize("array, values, lengths, inner", [
    (pa.array([1, 2, 3], pa.int8()), [1, 2, 3], None, ()),
    (pa.array([decimal.Decimal("1.5"), decimal.Decimal("2.25")]), [1.5, 2.25], None, ()),
    (pa.array([True, False]), [True, False], None, ()),
    (pa.array([b"ab", b"", b"xyz"]).slice(1), list(b"xyz"), [0, 3], ()),
    (pa.array([[1, 2], [3]], pa.list_(pa.int64())), [1, 2, 3], [2, 1], ()),
    (pa.array([[[1, 2], [3, 4]], [[5, 6]]]), [[1, 2], [3, 4], [5, 6]], [2, 1], (2,)),
])
def test_arrow_columns_become_values_lengths_and_inner_shapes(array, values, lengths, inner):
    got_values, got_lengths, got_inner = arrow_values(array, "c")
    assert got_values.tolist() == values and got_inner == inner
    assert (got_lengths.tolist() if got_lengths is not None else None) == lengths


def test_arrays_of_arrays_need_one_inner_size():
    with pytest.raises(InputDataError, match="'c' holds arrays of arrays whose inner arrays differ"):
        arrow_values(pa.array([[[1, 2], [3]]]), "c")


def test_read_rows_concatenates_batches_and_splits_validation():
    batches = [_batch([[1, 1], [2, 2]], [1.0, 2.0], [False, True]),
               _batch([[3, 3]], [3.0], [False])]
    ingested = read_rows(iter(batches), features_schema(2))
    features = ingested.train.inputs[0]
    assert isinstance(features, DenseColumn) and features.dtype == torch.float32
    np.testing.assert_array_equal(features.tensor.numpy(), [[1, 1], [3, 3]])
    np.testing.assert_array_equal(ingested.train.labels.tensor.numpy(), [1.0, 3.0])
    np.testing.assert_array_equal(ingested.validation.inputs[0].tensor.numpy(), [[2, 2]])
    assert ingested.train.labels.dtype == torch.float32


def test_typed_inputs_keep_their_types_and_ragged_arrays_their_lengths():
    schema = InputSchema(INPUTS_LAYOUT, (InputColumn("user", "int64", 0, "bigint"),
                                         InputColumn("tokens", "int64", 1, "array<int>"),
                                         InputColumn("image", "uint8", 1, "binary")), padding_value=-1)
    ids = [2 ** 40 + 1, 2 ** 53 + 3]
    batch = pa.RecordBatch.from_arrays(
        [pa.array(ids), pa.array([[5, 6, 7], [8]], pa.list_(pa.int64())), pa.array([b"\x01\x02", b"\xff\x00"]),
         pa.array([1.0, 0.0]), pa.array([0.5, 2.0], pa.float32())],
        [input_column(0), input_column(1), input_column(2), LABEL, WEIGHT])
    train = read_rows(iter([batch]), schema, ColumnNames(weight="w")).train
    user, tokens, image = train.inputs
    assert user.tensor.tolist() == ids, "ids above 2**24 stay exact"
    assert isinstance(tokens, RaggedColumn) and tokens.take(torch.tensor([1, 0])).tolist() == [[8, -1, -1], [5, 6, 7]]
    assert image.dtype == torch.uint8 and image.tensor.tolist() == [[1, 2], [255, 0]]
    assert train.weights.tensor.tolist() == [0.5, 2.0]


def test_integer_labels_stay_integers_until_the_model_says_what_they_are():
    ingested = read_rows(iter([_batch([[1.0]], pa.array([3], pa.int64()))]), features_schema(1))
    assert ingested.train.labels.dtype == torch.int64


def test_null_labels_are_rejected_naming_the_column():
    with pytest.raises(InputDataError, match="'target'"):
        read_rows(iter([_batch([[1.0], [2.0]], [1.0, None])]), features_schema(1), ColumnNames(label="target"))


def test_negative_weights_are_refused_naming_the_column():
    batch = _batch([[1.0], [2.0]], [1.0, 2.0])
    batch = pa.RecordBatch.from_arrays([*batch.columns, pa.array([1.0, -1.0])], [*batch.schema.names, WEIGHT])
    with pytest.raises(InputDataError, match="weightCol 'w' holds negative"):
        read_rows(iter([batch]), features_schema(1), ColumnNames(weight="w"))


def _vectors(rows) -> pa.StructArray:
    """Rows given as a list of values (dense) or (size, {index: value}) (sparse)."""
    types, sizes, indices, values = [], [], [], []
    for row in rows:
        if isinstance(row, list):
            types.append(1), sizes.append(None), indices.append(None), values.append(row)
        else:
            size, entries = row
            types.append(0), sizes.append(size), indices.append(list(entries)), values.append(list(entries.values()))
    return pa.StructArray.from_arrays(
        [pa.array(types, pa.int8()), pa.array(sizes, pa.int32()), pa.array(indices, pa.list_(pa.int32())),
         pa.array(values, pa.list_(pa.float64()))], names=["type", "size", "indices", "values"])


def test_dense_and_sparse_rows_become_one_matrix_also_when_sliced():
    array = _vectors([[9.0, 9.0, 9.0], (3, {2: 5.0}), [1.0, 2.0, 3.0], (3, {0: 4.0, 1: 6.0}), (3, {})])
    np.testing.assert_array_equal(vectors_to_matrix(array, "v"), [[9, 9, 9], [0, 0, 5], [1, 2, 3], [4, 6, 0],
                                                                 [0, 0, 0]])
    np.testing.assert_array_equal(vectors_to_matrix(array.slice(2), "v"), [[1, 2, 3], [4, 6, 0], [0, 0, 0]])
    assert vectors_to_matrix(array, "v").dtype == np.float32


def test_all_dense_and_empty():
    np.testing.assert_array_equal(vectors_to_matrix(_vectors([[1.0, 2.0], [3.0, 4.0]]), "v"), [[1, 2], [3, 4]])
    assert vectors_to_matrix(_vectors([]), "v").shape[0] == 0


def test_vectors_of_different_sizes_and_null_rows_are_refused():
    with pytest.raises(InputDataError, match="'v' holds vectors of sizes 2 to 3"):
        vectors_to_matrix(_vectors([[1.0, 2.0], (3, {0: 1.0})]), "v")
    array = _vectors([[1.0, 2.0], [3.0, 4.0]])
    nulled = pa.StructArray.from_arrays(array.flatten(), names=["type", "size", "indices", "values"],
                                        mask=pa.array([False, True]))
    with pytest.raises(InputDataError, match="1 null rows"):
        vectors_to_matrix(nulled, "v")
