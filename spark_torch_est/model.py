"""[driver] TorchModel: a Spark ML Transformer for batched inference, evaluation, save/load."""

from __future__ import annotations

import dataclasses
import hashlib
import io
from typing import Any, Callable

import cloudpickle
import torch
from pyspark.ml import Model
from pyspark.sql import DataFrame
from pyspark.sql import types as T

from spark_torch_est.checkpoint import Checkpoint
from spark_torch_est.creators import Creators
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.frames import feature_column, features_kind, label_column
from spark_torch_est.inference import EVALUATION_SCHEMA, ScoringSpec, evaluate_task, predict_task
from spark_torch_est.metrics import MetricAccumulator
from spark_torch_est.params import MODEL_DEFAULTS, ModelParams
from spark_torch_est.persistence import TorchPersistence
from spark_torch_est.protocol import FEATURES, LABEL

__all__ = ["TorchModel"]


class TorchModel(Model, ModelParams, TorchPersistence):
    """A trained model: ``transform`` appends predictions, ``evaluate`` computes the loss
    and metrics, ``torch_model()`` returns the module.

    Args:
        creators: The estimator's creators (model, loss, metrics and config are used).
        checkpoint: The checkpoint the weights come from.

    The prediction column is a double for one output per row and ``array<float>`` for
    several. For classifiers (integer labels, several outputs) it is the class index,
    with softmax probabilities in ``probabilityCol`` when that Param is set.
    """

    def __init__(self, creators: Creators | None = None, checkpoint: Checkpoint | None = None) -> None:
        super().__init__()
        self._setDefault(**MODEL_DEFAULTS)
        self._creators = dataclasses.replace(creators, optimizer=None, scheduler=None, hooks={}) \
            if creators is not None else None
        self._checkpoint = checkpoint

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint this model was built from (``fit(resume_from=model)`` continues it)."""
        return self._checkpoint

    @property
    def history(self) -> list[dict]:
        """Per-epoch metrics of the run up to this model."""
        return self._checkpoint.history

    def torch_model(self) -> torch.nn.Module:
        """The trained ``nn.Module`` on the CPU, in eval mode."""
        model = self._creators.build_model()
        model.load_state_dict(self._checkpoint.model_state)
        return model.cpu().eval()

    def _scoring_spec(self, **fields: Any) -> ScoringSpec:
        weights = io.BytesIO()
        torch.save(self._checkpoint.model_state, weights)
        return ScoringSpec(key=hashlib.sha256(weights.getbuffer()).hexdigest(),
                           creators=cloudpickle.dumps(self._creators), weights=weights.getvalue(),
                           batch_size=self.getInferenceBatchSize(), **fields)

    def _output_kind(self) -> str:
        checkpoint = self._checkpoint
        width = 1
        for dim in checkpoint.output_shape:
            width *= dim
        if checkpoint.label_kind == "int" and width > 1:
            return "class"
        return "scalar" if width == 1 else "vector"

    def _features(self, dataset: DataFrame) -> tuple[DataFrame, dict[str, Any]]:
        """The dataset with its features readable by the scoring tasks, and where they are:
        array and numeric columns are read as they are; only Vectors are converted."""
        kind = features_kind(dataset.schema, self.getFeaturesCol(), self.getFeatureCols())
        if kind == "columns":
            return dataset, {"feature_cols": tuple(self.getFeatureCols())}
        if kind == "array":
            return dataset, {"features_col": self.getFeaturesCol()}
        features = feature_column(dataset, self.getFeaturesCol(), self.getFeatureCols())
        return dataset.withColumn(FEATURES, features), {"features_col": FEATURES}

    def _transform(self, dataset: DataFrame) -> DataFrame:
        prepared, where = self._features(dataset)
        kind = self._output_kind()
        probability = self.getProbabilityCol() if kind == "class" else None
        added = [(self.getPredictionCol(), T.DoubleType() if kind != "vector" else T.ArrayType(T.FloatType()))]
        if probability:
            added.append((probability, T.ArrayType(T.FloatType())))
        for name, _ in added:
            if name in dataset.columns:
                raise InvalidInputError(f"the DataFrame already has a column {name!r}; set predictionCol/probabilityCol")
        schema = T.StructType(list(dataset.schema.fields) + [T.StructField(n, t, False) for n, t in added])
        spec = self._scoring_spec(prediction_col=self.getPredictionCol(), output=kind, probability_col=probability,
                                  **where)
        return prepared.mapInArrow(predict_task(spec), schema)

    def evaluate(self, dataset: DataFrame) -> dict[str, float]:
        """The loss and metrics over every row of ``dataset``, computed by Spark tasks.

        Returns:
            ``{"loss": ..., "<metric name>": ...}``: weighted by rows, exact for losses
            and metrics that are means over rows; stateful metrics (torchmetrics) are
            merged with their ``merge_state``.

        Raises:
            InvalidInputError: Missing or unusable columns (before any Spark job).
        """
        frame = dataset.select(feature_column(dataset, self.getFeaturesCol(), self.getFeatureCols()).alias(FEATURES),
                               label_column(dataset, self.getLabelCol()).alias(LABEL))
        spec = self._scoring_spec(label_name=self.getLabelCol())
        rows = frame.mapInArrow(evaluate_task(spec), EVALUATION_SCHEMA).collect()
        totals = torch.tensor([r["totals"] for r in rows], dtype=torch.float64).sum(dim=0)
        if not rows or totals[0] == 0:
            raise InvalidInputError("evaluate() got a DataFrame without rows")
        accumulator = MetricAccumulator(self._creators.build_loss(), self._creators.metrics, torch.device("cpu"))
        for i, name in enumerate(accumulator.names):
            for row in rows:
                if row["totals"][0] and row["metric_states"][i]:
                    try:
                        accumulator.merge(name, bytes(row["metric_states"][i]))
                    except TypeError as error:
                        raise InvalidInputError(str(error)) from None
        return accumulator.results(totals)

    # ---------------------------------------------------------------- persistence

    def _persisted_files(self) -> dict[str, bytes]:
        """The creators (model, loss, metrics and config, cloudpickled; a model keeps no
        optimizer or hooks) and the checkpoint (see persistence.py)."""
        return {"creators.pkl": cloudpickle.dumps(self._creators), "checkpoint.pt": self._checkpoint.to_bytes()}

    @classmethod
    def _from_files(cls, read: Callable[[str], bytes | None]) -> TorchModel:
        return cls(creators=cloudpickle.loads(read("creators.pkl")),
                   checkpoint=Checkpoint.from_bytes(read("checkpoint.pt")))
