"""[executor] Batched inference for ``TorchModel.transform``: Arrow in, Arrow out.

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

from spark_torch_est.data import FEATURES, list_column_to_matrix

__all__ = ["PredictSpec", "predict_task", "load_model"]

_CACHE: OrderedDict[str, torch.nn.Module] = OrderedDict()
_CACHE_SIZE = 2


@dataclass(frozen=True)
class PredictSpec:
    """What a scoring task needs.

    Attributes:
        key: Digest of the weights; the per-process cache key.
        model_payload: cloudpickled ``(model creator or module, config)``.
        weights: ``torch.save`` of the model's state_dict.
        batch_size: Rows per forward pass.
        prediction_col: Name of the output column.
        output: ``"scalar"`` (double), ``"vector"`` (array<float>) or ``"class"`` (argmax).
        probability_col: Softmax column for ``"class"`` outputs, or None.
    """

    key: str
    model_payload: bytes
    weights: bytes
    batch_size: int
    prediction_col: str
    output: str
    probability_col: str | None = None


def load_model(spec: PredictSpec) -> torch.nn.Module:
    """Builds the model (CPU or the task's GPU), once per process and weights."""
    model = _CACHE.get(spec.key)
    if model is None:
        from spark_torch_est.creators import Creators

        module_or_creator, config = cloudpickle.loads(spec.model_payload)
        model = Creators(model=module_or_creator, optimizer=None, loss=None, config=config).build_model()
        model.load_state_dict(torch.load(io.BytesIO(spec.weights), map_location="cpu", weights_only=True))
        model.eval()
        if torch.cuda.is_available():
            model.to("cuda")
        _CACHE[spec.key] = model
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(spec.key)
    return model


def predict_task(spec: PredictSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Returns the ``mapInArrow`` function that appends predictions to every batch."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        model = load_model(spec)
        device = next(model.parameters(), torch.empty(0)).device
        for batch in batches:
            features = list_column_to_matrix(batch.column(FEATURES), "features")
            outputs = _forward(model, features, spec.batch_size, device)
            kept = batch.drop_columns([FEATURES])
            for name, column in _columns(spec, outputs):
                kept = kept.append_column(name, column)
            yield kept

    return task


def _forward(model: torch.nn.Module, features: np.ndarray, batch_size: int, device: torch.device) -> np.ndarray:
    parts = []
    with torch.inference_mode():
        for start in range(0, len(features), batch_size):
            inputs = torch.tensor(features[start:start + batch_size], device=device)  # Arrow memory is read-only
            parts.append(model(inputs).float().cpu())
    if not parts:
        return np.zeros((0, 1), dtype=np.float32)
    outputs = torch.cat(parts)
    return outputs.reshape(len(outputs), -1).numpy()


def _columns(spec: PredictSpec, outputs: np.ndarray) -> list[tuple[str, pa.Array]]:
    if spec.output == "scalar":
        return [(spec.prediction_col, pa.array(outputs[:, 0].astype(np.float64)))]
    if spec.output == "vector":
        return [(spec.prediction_col, _matrix_to_list(outputs))]
    columns = [(spec.prediction_col, pa.array(outputs.argmax(axis=1).astype(np.float64)))]
    if spec.probability_col:
        shifted = np.exp(outputs - outputs.max(axis=1, keepdims=True))
        columns.append((spec.probability_col, _matrix_to_list(shifted / shifted.sum(axis=1, keepdims=True))))
    return columns


def _matrix_to_list(matrix: np.ndarray) -> pa.Array:
    matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    offsets = pa.array(np.arange(len(matrix) + 1, dtype=np.int32) * matrix.shape[1])
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1)))
