"""[both] ``TorchModel.predict_udf()``: the model as a batched Arrow column function.

The function is an Arrow UDF (``pyspark.sql.functions.arrow_udf``, pyspark >= 4.1): Spark
hands it Arrow batches of its argument columns, and it scores them with the same
per-process model cache and the same input handling as ``transform``
(:func:`spark_torch_est.scoring.inference.load_model`, :func:`~spark_torch_est.scoring.inference.read_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from spark_torch_est.core.worker_gc import freeze_older
from spark_torch_est.errors import InputDataError
from spark_torch_est.scoring.inference import ScoringSpec, load_model, output_columns, predict_outputs, read_inputs

__all__ = ["arrow_predict_function"]


def arrow_predict_function(spec: ScoringSpec, as_array: bool = False) -> Callable[..., pa.Array]:
    """The scalar Arrow UDF body: argument columns in, the one output column ``spec`` names out.

    The arguments are the model's input columns in order, as ``spec.columns`` lists them:
    one Vector, array or numeric column; the numeric columns of a ``featureCols`` model;
    or one column per input of an ``inputCols`` model (``model(*inputs)``), each keeping
    its type.

    Args:
        spec: The scoring spec with exactly one output column named.
        as_array: Give a Vector output as the ``array<double>`` of its values.
    """

    def predict(*columns: pa.Array) -> pa.Array:
        if len(columns) != len(spec.columns):
            raise InputDataError(f"predict_udf() takes {len(spec.columns)} column(s) (the model's inputs "
                                 f"{list(spec.columns)}, in order), got {len(columns)}")
        freeze_older()  # a column function has no task start: once per task, at its first batch
        inputs = read_inputs(list(columns), spec)
        ((_, column),) = output_columns(spec, predict_outputs(load_model(spec), inputs, spec))
        return column.field("values") if as_array else column

    return predict
