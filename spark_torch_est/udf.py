"""[both] ``TorchModel.predict_udf()``: the model as a batched Arrow column function.

The function is an Arrow UDF (``pyspark.sql.functions.arrow_udf``, pyspark >= 4.1): Spark
hands it Arrow batches of its argument columns, and it scores them with the same
per-process model cache as ``transform`` (:func:`spark_torch_est.inference.load_model`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa

from spark_torch_est.data import column_to_numpy, list_column_to_matrix
from spark_torch_est.errors import InputDataError
from spark_torch_est.inference import ScoringSpec, load_model, output_columns, predict_outputs

__all__ = ["arrow_predict_function", "vectors_to_matrix"]

_DENSE = 1


def vectors_to_matrix(array: pa.StructArray, name: str) -> np.ndarray:
    """Spark ML Vectors, as Arrow carries VectorUDT (a struct of type, size, indices and
    values; type 0 is sparse, 1 dense), as an ``(n, d)`` float32 matrix, without per-row Python.

    Raises:
        InputDataError: A row is null, or the vectors differ in size.
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise InputDataError(f"column {name!r} has {array.null_count} null rows in this batch")
    rows = len(array)
    dense = array.field("type").to_numpy(zero_copy_only=False) == _DENSE
    values = array.field("values")
    if dense.all():
        return list_column_to_matrix(values, name).astype(np.float32, copy=False)
    offsets = values.offsets.to_numpy()
    offsets = offsets - offsets[0]  # a sliced array's offsets do not start at 0
    lengths = np.diff(offsets)
    sizes = np.where(dense, lengths, array.field("size").fill_null(0).to_numpy(zero_copy_only=False))
    if not (sizes == sizes[0]).all():
        raise InputDataError(f"column {name!r} holds vectors of sizes {int(sizes.min())} to {int(sizes.max())}; "
                             "every row needs the same size")
    row_of_value = np.repeat(np.arange(rows), lengths)
    position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    sparse_value = ~dense[row_of_value]
    position[sparse_value] = array.field("indices").flatten().to_numpy(zero_copy_only=False)
    matrix = np.zeros((rows, int(sizes[0])), dtype=np.float32)
    matrix[row_of_value, position] = values.flatten().to_numpy(zero_copy_only=False)
    return matrix


def _as_matrix(array: pa.Array, name: str) -> np.ndarray:
    """One argument column as an ``(n, d)`` float32 matrix (a numeric column gives d = 1)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_struct(array.type):
        return vectors_to_matrix(array, name)
    values = column_to_numpy(array, name)
    return values.reshape(len(values), -1).astype(np.float32, copy=False)


def arrow_predict_function(spec: ScoringSpec, arguments: int) -> Callable[..., pa.Array]:
    """The scalar Arrow UDF body: argument columns in, the one output column ``spec`` names out.

    Every argument becomes an ``(n, d_i)`` matrix and the model gets them side by side as
    one features tensor, which covers one Vector, array or numeric column as well as the
    numeric columns of a ``featureCols`` model, in their order. The arguments are a list of
    columns so that a model with several typed inputs can take one argument per input
    (``model(*inputs)``) without a new signature: only this combining step changes.

    Args:
        spec: The scoring spec with exactly one output column named.
        arguments: How many columns the model expects (``len(featureCols)``, else 1).
    """

    def predict(*columns: pa.Array) -> pa.Array:
        if len(columns) != arguments:
            raise InputDataError(f"predict_udf() takes {arguments} column(s) in the model's feature order, "
                                 f"got {len(columns)}")
        matrices = [_as_matrix(column, f"argument {i + 1}") for i, column in enumerate(columns)]
        features = matrices[0] if len(matrices) == 1 else np.concatenate(matrices, axis=1)
        ((_, column),) = output_columns(spec, predict_outputs(load_model(spec), features, spec.batch_size))
        return column

    return predict
