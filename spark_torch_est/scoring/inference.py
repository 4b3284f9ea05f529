"""[executor] Batched scoring for ``TorchModel.transform`` and ``TorchModel.evaluate``.

The model is built once per Python worker process and cached by the digest of its
weights, so a reused worker scores every later batch and task without reloading.
"""

from __future__ import annotations

import io
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import cloudpickle
import numpy as np
import pyarrow as pa
import torch

from spark_torch_est.core.arrow import binary_array, from_numpy
from spark_torch_est.core.schema import FEATURES_LAYOUT, InputSchema
from spark_torch_est.core.worker_gc import freeze_older, unfreeze_if_alive
from spark_torch_est.errors import InputDataError
from spark_torch_est.ingest.agreement import shape_labels
from spark_torch_est.ingest.columns import Column, ColumnBuilder, DenseColumn
from spark_torch_est.ingest.tables import TORCH_DTYPES, arrow_values, stack_columns
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.devices import cpu_despite_gpus, task_device, task_gpus
from spark_torch_est.train.lightning import scorer
from spark_torch_est.train.losses import Loss
from spark_torch_est.train.metrics import MetricAccumulator
from spark_torch_est.train.precision import autocast
from spark_torch_est.train.step import checked_outputs

__all__ = ["ScoringSpec", "predict_task", "evaluate_task", "EVALUATION_SCHEMA", "load_model", "model_device",
           "read_inputs", "read_targets", "predict_outputs", "output_columns"]

logger = logging.getLogger(__name__)

_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_CACHE: OrderedDict[tuple[str, str], torch.nn.Module] = OrderedDict()
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
        schema: The model's inputs as trained (``InputSchema.to_dict()``).
        columns: The DataFrame's columns to read, one per input in order (for
            ``featureCols``: the numeric columns stacked into the one input).
        prediction_col: Name of the prediction column ('' or None: omitted).
        output: ``"scalar"`` (double), ``"vector"`` (array<float>) or ``"class"`` (argmax).
        raw_prediction_col: For ``"class"`` outputs: the column of the outputs (logits) as
            Spark ML Vectors ('' or None: omitted).
        probability_col: For ``"class"`` outputs: the column of their softmax as Spark ML
            Vectors ('' or None: omitted).
        label_col: The label column (``evaluate``).
        weight_col: The sample-weight column (``evaluate``), or None.
        precision: The ``precision`` the model was trained under: its forward passes and
            losses run under the same autocast.
    """

    key: str
    creators: bytes
    weights: bytes
    batch_size: int
    schema: dict
    columns: tuple[str, ...]
    prediction_col: str = "prediction"
    output: str = "scalar"
    raw_prediction_col: str | None = None
    probability_col: str | None = None
    label_col: str = "label"
    weight_col: str | None = None
    precision: str = "32"

    @property
    def stacked(self) -> bool:
        """Whether the columns are ``featureCols``, stacked into one float32 input."""
        return self.input_schema.layout == FEATURES_LAYOUT and len(self.columns) > 1

    @property
    def input_schema(self) -> InputSchema:
        return InputSchema.from_dict(self.schema)


def read_inputs(arrays: list[pa.Array], spec: ScoringSpec) -> list[Column]:
    """The model's inputs from the batch's columns: each column keeps its type; arrays
    of different lengths come out padded per forward pass.

    Raises:
        InputDataError: Nulls, or arrays the model cannot take.
    """
    schema = spec.input_schema
    if spec.stacked:
        return [DenseColumn(torch.from_numpy(stack_columns(arrays, spec.columns)))]
    inputs = []
    for array, name, column in zip(arrays, spec.columns, schema.columns):
        values, lengths, inner = arrow_values(array, name)
        if schema.layout == FEATURES_LAYOUT and lengths is None:  # one number per row: one feature
            lengths = np.ones(len(values), dtype=np.int64)
        # the batch's rows are known: one buffer of that many, as the batch's one copy
        builder = ColumnBuilder(TORCH_DTYPES[column.dtype], capacity=len(array))
        builder.append(values, lengths, inner)
        rows = builder.finish(schema.padding_value)
        if rows is None:
            rows = DenseColumn(torch.empty(0, dtype=TORCH_DTYPES[column.dtype]))
        if schema.layout == FEATURES_LAYOUT and rows.row_shape is None:
            raise InputDataError(f"column {name!r} holds arrays of different lengths; every row needs the same length")
        inputs.append(rows)
    return inputs


def read_targets(batch: pa.RecordBatch, spec: ScoringSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The batch's labels as training reads them (int64 for integers, else float32; one row
    per label) and its sample weights under ``weightCol`` (float32), else None."""
    values, lengths, _ = arrow_values(batch.column(spec.label_col), spec.label_col)
    labels = torch.from_numpy(np.array(values if lengths is None else values.reshape(len(lengths), -1)))
    labels = labels.long() if labels.dtype in _INTEGERS else labels.float()
    weights = (torch.from_numpy(np.array(arrow_values(batch.column(spec.weight_col), spec.weight_col)[0],
                                         dtype=np.float32)) if spec.weight_col else None)
    return labels, weights


def load_model(spec: ScoringSpec) -> torch.nn.Module:
    """Builds the model in eval mode on the task's device, once per process, weights and
    device: the GPU Spark gave the task, else one of the executor's GPUs by partition,
    else the CPU (see :func:`spark_torch_est.train.devices.choose_device`)."""
    gpus, partition = task_gpus()
    device = task_device(None, gpus, partition)
    key = (spec.key, str(device))
    model = _CACHE.get(key)
    if model is None:
        note = cpu_despite_gpus(device, gpus, None)
        if note is not None:
            logger.warning("%s", note)
        creators: Creators = cloudpickle.loads(spec.creators)
        model = creators.build_model()
        model.load_state_dict(torch.load(io.BytesIO(spec.weights), map_location="cpu", weights_only=True))
        model.eval()
        model.to(device)
        _CACHE[key] = model
        while len(_CACHE) > _CACHE_SIZE:
            unfreeze_if_alive(weakref.ref(_CACHE.popitem(last=False)[1]))
    _CACHE.move_to_end(key)
    return model


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's parameters are (the CPU for a model without any)."""
    return next(model.parameters(), torch.empty(0)).device


def _forward(model: torch.nn.Module, inputs: list[Column], spec: ScoringSpec) -> Iterator[tuple[int, torch.Tensor]]:
    """Yields (start row, outputs) per chunk of ``spec.batch_size`` rows: the model's forward,
    or a LightningModule's own ``predict_step`` (see :func:`scorer`)."""
    device, schema = model_device(model), spec.input_schema
    rows = len(inputs[0]) if inputs else 0
    method, call = scorer(model)
    with torch.inference_mode():
        for index, start in enumerate(range(0, rows, spec.batch_size)):
            chunk = schema.model_inputs([x.slice(start, start + spec.batch_size).to(device) for x in inputs])
            with autocast(spec.precision, device):
                outputs = checked_outputs(call(chunk, index), model, method)
            yield start, outputs


def predict_outputs(model: torch.nn.Module, inputs: list[Column], spec: ScoringSpec) -> np.ndarray:
    """The model's outputs for every row of ``inputs`` as an ``(n, k)`` float32 matrix."""
    rows = len(inputs[0]) if inputs else 0
    parts = [out.float().cpu() for _, out in _forward(model, inputs, spec)]
    return torch.cat(parts).reshape(rows, -1).numpy() if parts else np.zeros((0, 1), np.float32)


def predict_task(spec: ScoringSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Returns the ``mapInArrow`` function that appends predictions to every batch."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        freeze_older()
        model = load_model(spec)
        for batch in batches:
            inputs = read_inputs([batch.column(name) for name in spec.columns], spec)
            outputs = predict_outputs(model, inputs, spec)
            added = list(output_columns(spec, outputs))  # RecordBatch.append_column is pyarrow 15's
            yield pa.RecordBatch.from_arrays([*batch.columns, *(column for _, column in added)],
                                             names=[*batch.schema.names, *(name for name, _ in added)])

    return task


def evaluate_task(spec: ScoringSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Returns the ``mapInArrow`` function that accumulates the loss and metrics of a partition."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        freeze_older()
        model = load_model(spec)
        creators: Creators = cloudpickle.loads(spec.creators)
        accumulator = MetricAccumulator(Loss(creators.build_loss()), creators.metrics, model_device(model))
        for batch in batches:
            inputs = read_inputs([batch.column(name) for name in spec.columns], spec)
            labels, weights = read_targets(batch, spec)
            for start, outputs in _forward(model, inputs, spec):
                stop = start + len(outputs)
                target = shape_labels(labels[start:stop], list(outputs.shape[1:]), spec.label_col,
                                      creators.loss_reads_labels_as_read).to(outputs.device)
                with autocast(spec.precision, outputs.device):  # the loss as validation computes it
                    accumulator.update(outputs, target, weights[start:stop].to(outputs.device) if weights is not None
                                       else None)
        yield _evaluated(accumulator.totals().cpu().numpy(), accumulator.states())

    return task


def _evaluated(totals: np.ndarray, states: list[bytes]) -> pa.RecordBatch:
    """A partition's loss totals and metric states as ``evaluate_task``'s one row."""
    states_row = pa.ListArray.from_arrays(from_numpy(np.array([0, len(states)], np.int32)), binary_array(states))
    return pa.RecordBatch.from_arrays([_matrix_to_list(totals.reshape(1, -1), np.float64), states_row],
                                      names=["totals", "metric_states"])


def output_columns(spec: ScoringSpec, outputs: np.ndarray) -> list[tuple[str, pa.Array]]:
    """The output columns of one batch; a column whose name is empty is left out."""
    columns: list[tuple[str | None, pa.Array]]
    if spec.output == "scalar":
        columns = [(spec.prediction_col, from_numpy(outputs[:, 0].astype(np.float64)))]
    elif spec.output == "vector":
        columns = [(spec.prediction_col, _matrix_to_list(outputs))]
    else:
        logits = outputs.astype(np.float64)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        columns = [(spec.prediction_col, from_numpy(outputs.argmax(axis=1).astype(np.float64))),
                   (spec.raw_prediction_col, _dense_vectors(logits)),
                   (spec.probability_col, _dense_vectors(shifted / shifted.sum(axis=1, keepdims=True)))]
    return [(name, column) for name, column in columns if name]


def _matrix_to_list(matrix: np.ndarray, dtype: type = np.float32) -> pa.Array:
    matrix = np.ascontiguousarray(matrix, dtype=dtype)
    offsets = from_numpy(np.arange(len(matrix) + 1, dtype=np.int32) * matrix.shape[1])
    return pa.ListArray.from_arrays(offsets, from_numpy(matrix.reshape(-1)))


def _dense_vectors(matrix: np.ndarray) -> pa.StructArray:
    """Rows as Spark ML dense Vectors: the Arrow layout of VectorUDT's SQL type
    (type 1 = dense, then size, indices, values)."""
    rows = len(matrix)
    return pa.StructArray.from_arrays(
        [from_numpy(np.ones(rows, dtype=np.int8)), pa.nulls(rows, pa.int32()), pa.nulls(rows, pa.list_(pa.int32())),
         _matrix_to_list(matrix, np.float64)],
        names=["type", "size", "indices", "values"],
    )
