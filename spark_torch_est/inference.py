"""[executor] Batched scoring for ``TorchModel.transform`` and ``TorchModel.evaluate``.

The model is built once per Python worker process and cached by the digest of its
weights, so a reused worker scores every later batch and task without reloading.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

import cloudpickle
import numpy as np
import pyarrow as pa
import torch

from spark_torch_est.creators import Creators
from spark_torch_est.data import column_to_numpy, list_column_to_matrix, shape_labels
from spark_torch_est.metrics import MetricAccumulator
from spark_torch_est.protocol import FEATURES, LABEL

__all__ = ["ScoringSpec", "predict_task", "evaluate_task", "EVALUATION_SCHEMA", "load_model", "predict_outputs",
           "output_columns"]

_CACHE: OrderedDict[str, torch.nn.Module] = OrderedDict()
_CACHE_SIZE = 2
#: One row per partition: :meth:`MetricAccumulator.totals` and ``states``.
EVALUATION_SCHEMA = "totals array<double>, metric_states array<binary>"


@dataclass(frozen=True)
class ScoringSpec:
    """What a scoring task needs.

    Attributes:
        key: Digest of the weights; the per-process cache key.
        creators: cloudpickled :class:`Creators` (model, loss, metrics, config).
        weights: ``torch.save`` of the model's state_dict.
        batch_size: Rows per forward pass.
        prediction_col: Name of the prediction column ('' or None: omitted).
        output: ``"scalar"`` (double), ``"vector"`` (array<float>) or ``"class"`` (argmax).
        raw_prediction_col: For ``"class"`` outputs: the column of the outputs (logits) as
            Spark ML Vectors ('' or None: omitted).
        probability_col: For ``"class"`` outputs: the column of their softmax as Spark ML
            Vectors ('' or None: omitted).
        label_name: The label column, for messages.
        features_col: The column holding the features as arrays (the input's own column
            when it already is one, else a converted copy that is dropped again).
        feature_cols: Numeric columns stacked into the features, instead of ``features_col``.
    """

    key: str
    creators: bytes
    weights: bytes
    batch_size: int
    prediction_col: str = "prediction"
    output: str = "scalar"
    raw_prediction_col: str | None = None
    probability_col: str | None = None
    label_name: str = "label"
    features_col: str = FEATURES
    feature_cols: tuple[str, ...] = ()


def _features(batch: pa.RecordBatch, spec: ScoringSpec) -> np.ndarray:
    """The batch's features as an ``(n, d)`` matrix, read straight from its columns."""
    if spec.feature_cols:
        columns = [column_to_numpy(batch.column(name), name) for name in spec.feature_cols]
        return np.stack(columns, axis=1).astype(np.float32, copy=False)
    return list_column_to_matrix(batch.column(spec.features_col), spec.features_col).astype(np.float32, copy=False)


def load_model(spec: ScoringSpec) -> torch.nn.Module:
    """Builds the model in eval mode (on the GPU when there is one), once per process and weights."""
    model = _CACHE.get(spec.key)
    if model is None:
        creators: Creators = cloudpickle.loads(spec.creators)
        model = creators.build_model()
        model.load_state_dict(torch.load(io.BytesIO(spec.weights), map_location="cpu", weights_only=True))
        model.eval()
        if torch.cuda.is_available():
            model.to("cuda")
        _CACHE[spec.key] = model
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(spec.key)
    return model


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


def _forward(model: torch.nn.Module, features: np.ndarray, batch_size: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yields (start row, outputs) per chunk of ``batch_size`` rows."""
    device = _device(model)
    with torch.inference_mode():
        for start in range(0, len(features), batch_size):
            inputs = torch.tensor(features[start:start + batch_size], device=device)  # Arrow memory is read-only
            yield start, model(inputs)


def predict_outputs(model: torch.nn.Module, features: np.ndarray, batch_size: int) -> np.ndarray:
    """The model's outputs for ``(n, d)`` features as an ``(n, k)`` float32 matrix."""
    parts = [out.float().cpu() for _, out in _forward(model, features, batch_size)]
    return torch.cat(parts).reshape(len(features), -1).numpy() if parts else np.zeros((0, 1), np.float32)


def predict_task(spec: ScoringSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Returns the ``mapInArrow`` function that appends predictions to every batch."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        model = load_model(spec)
        for batch in batches:
            outputs = predict_outputs(model, _features(batch, spec), spec.batch_size)
            converted = not spec.feature_cols and spec.features_col == FEATURES  # a copy made for the task
            kept = batch.drop_columns([FEATURES]) if converted else batch
            for name, column in output_columns(spec, outputs):
                kept = kept.append_column(name, column)
            yield kept

    return task


def evaluate_task(spec: ScoringSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Returns the ``mapInArrow`` function that accumulates the loss and metrics of a partition."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        model = load_model(spec)
        creators: Creators = cloudpickle.loads(spec.creators)
        device = _device(model)
        accumulator = MetricAccumulator(creators.build_loss(), creators.metrics, device)
        for batch in batches:
            features = _features(batch, spec)
            labels = torch.from_numpy(np.array(column_to_numpy(batch.column(LABEL), spec.label_name)))
            if labels.is_floating_point():
                labels = labels.float()
            for start, outputs in _forward(model, features, spec.batch_size):
                target = shape_labels(labels[start:start + len(outputs)], list(outputs.shape[1:]), spec.label_name)
                accumulator.update(outputs, target.to(outputs.device))
        yield pa.RecordBatch.from_pydict(
            {"totals": [accumulator.totals().tolist()], "metric_states": [accumulator.states()]},
            schema=pa.schema([("totals", pa.list_(pa.float64())), ("metric_states", pa.list_(pa.binary()))]),
        )

    return task


def output_columns(spec: ScoringSpec, outputs: np.ndarray) -> list[tuple[str, pa.Array]]:
    """The output columns of one batch; a column whose name is empty is left out."""
    if spec.output == "scalar":
        columns = [(spec.prediction_col, pa.array(outputs[:, 0].astype(np.float64)))]
    elif spec.output == "vector":
        columns = [(spec.prediction_col, _matrix_to_list(outputs))]
    else:
        logits = outputs.astype(np.float64)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        columns = [(spec.prediction_col, pa.array(outputs.argmax(axis=1).astype(np.float64))),
                   (spec.raw_prediction_col, _dense_vectors(logits)),
                   (spec.probability_col, _dense_vectors(shifted / shifted.sum(axis=1, keepdims=True)))]
    return [(name, column) for name, column in columns if name]


def _matrix_to_list(matrix: np.ndarray, dtype: type = np.float32) -> pa.Array:
    matrix = np.ascontiguousarray(matrix, dtype=dtype)
    offsets = pa.array(np.arange(len(matrix) + 1, dtype=np.int32) * matrix.shape[1])
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1)))


def _dense_vectors(matrix: np.ndarray) -> pa.StructArray:
    """Rows as Spark ML dense Vectors: the Arrow layout of VectorUDT's SQL type
    (type 1 = dense, then size, indices, values)."""
    rows = len(matrix)
    return pa.StructArray.from_arrays(
        [pa.array(np.ones(rows, dtype=np.int8)), pa.nulls(rows, pa.int32()), pa.nulls(rows, pa.list_(pa.int32())),
         _matrix_to_list(matrix, np.float64)],
        names=["type", "size", "indices", "values"],
    )
