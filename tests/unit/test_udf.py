"""predict_udf's reading of Spark ML Vectors as Arrow carries them (VectorUDT's struct)."""

import numpy as np
import pyarrow as pa
import pytest

from spark_torch_est.errors import InputDataError
from spark_torch_est.udf import vectors_to_matrix


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
