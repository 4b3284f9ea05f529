"""[driver] TorchModel: a Spark ML Transformer for batched inference, with save/load."""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any

import cloudpickle
import torch
from pyspark.ml import Model
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import DataFrame
from pyspark.sql import types as T

from spark_torch_est.checkpoint import Checkpoint
from spark_torch_est.creators import Creators
from spark_torch_est.data import FEATURES
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.frames import feature_column
from spark_torch_est.inference import PredictSpec, predict_task
from spark_torch_est.params import MODEL_DEFAULTS, ModelParams
from spark_torch_est.storage import read_bytes, write_atomic

__all__ = ["TorchModel"]


class TorchModel(Model, ModelParams, MLReadable, MLWritable):
    """A trained model: ``transform`` appends predictions; ``torch_model()`` returns the module.

    Args:
        model: The ``nn.Module`` or ``callable(config)`` the estimator was given.
        config: The estimator's config dict.
        checkpoint: The checkpoint the weights come from.

    The prediction column is a double for one output per row, ``array<float>`` for several;
    for classifiers (integer labels, several outputs) it is the class index, with softmax
    probabilities in ``probabilityCol`` when that Param is set.
    """

    def __init__(self, model: Any = None, config: dict | None = None, checkpoint: Checkpoint | None = None) -> None:
        super().__init__()
        self._setDefault(**MODEL_DEFAULTS)
        self._model_creator = model
        self._config = dict(config or {})
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
        model = Creators(model=self._model_creator, optimizer=None, loss=None, config=self._config).build_model()
        model.load_state_dict(self._checkpoint.model_state)
        return model.cpu().eval()

    def _output_kind(self) -> str:
        meta = self._checkpoint.meta
        width = 1
        for dim in meta["output_shape"]:
            width *= dim
        if meta["label_kind"] == "int" and width > 1:
            return "class"
        return "scalar" if width == 1 else "vector"

    def _transform(self, dataset: DataFrame) -> DataFrame:
        features = feature_column(dataset, self.getFeaturesCol(), self.getFeatureCols())
        kind = self._output_kind()
        added = [(self.getPredictionCol(), T.DoubleType() if kind != "vector" else T.ArrayType(T.FloatType()))]
        if kind == "class" and self.getProbabilityCol():
            added.append((self.getProbabilityCol(), T.ArrayType(T.FloatType())))
        for name, _ in added:
            if name in dataset.columns:
                raise InvalidInputError(f"the DataFrame already has a column {name!r}; set predictionCol/probabilityCol")
        schema = T.StructType(list(dataset.schema.fields) + [T.StructField(n, t, False) for n, t in added])
        weights = io.BytesIO()
        torch.save(self._checkpoint.model_state, weights)
        spec = PredictSpec(
            key=hashlib.sha256(weights.getbuffer()).hexdigest(),
            model_payload=cloudpickle.dumps((self._model_creator, self._config)),
            weights=weights.getvalue(), batch_size=self.getInferenceBatchSize(),
            prediction_col=self.getPredictionCol(), output=kind,
            probability_col=self.getProbabilityCol() if kind == "class" else None,
        )
        return dataset.withColumn(FEATURES, features).mapInArrow(predict_task(spec), schema)

    # ---------------------------------------------------------------- persistence

    def write(self) -> MLWriter:
        """Saves Params as JSON, the creator cloudpickled, and the checkpoint."""
        return _TorchModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        """Reads what :meth:`write` saved."""
        return _TorchModelReader(cls)


class _TorchModelWriter(MLWriter):
    def __init__(self, instance: TorchModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession.sparkContext)
        write_atomic(f"{path}/torch/creator.pkl", cloudpickle.dumps((self.instance._model_creator, self.instance._config)))
        write_atomic(f"{path}/torch/checkpoint.pt", self.instance.checkpoint.to_bytes())
        write_atomic(f"{path}/torch/README.json", json.dumps({"format": "spark_torch_est.TorchModel", "version": 1}).encode())


class _TorchModelReader(MLReader):
    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> TorchModel:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession.sparkContext)
        model, config = cloudpickle.loads(read_bytes(f"{path}/torch/creator.pkl"))
        instance = self.cls(model=model, config=config, checkpoint=Checkpoint.load(f"{path}/torch/checkpoint.pt"))
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        return instance
