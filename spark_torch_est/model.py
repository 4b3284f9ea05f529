"""[driver] TorchModel: a Spark ML Transformer for batched inference, evaluation, save/load."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
from pyspark.ml import Model
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T
from pyspark.sql.utils import is_remote

from spark_torch_est import moved
from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.core import jvm, support
from spark_torch_est.core.schema import FEATURES_LAYOUT
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.ingest.frames import check_inputs, input_schema, label_kind, weight_column
from spark_torch_est.ingest.parquet_plan import parquet_table
from spark_torch_est.ingest.parquet_read import over_parts
from spark_torch_est.params.base import EstimatorParams
from spark_torch_est.persistence import TorchPersistence, loaded_checkpoint, read_required, saved_checkpoint
from spark_torch_est.scoring.inference import EVALUATION_SCHEMA, ScoringSpec, evaluate_task, predict_task
from spark_torch_est.scoring.lightning import VALIDATION_SCHEMA, validate_task, validated
from spark_torch_est.scoring.predict_udf import arrow_predict_function
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.lightning import defines
from spark_torch_est.train.losses import Loss
from spark_torch_est.train.metrics import MetricAccumulator

__all__ = ["TorchModel"]

logger = logging.getLogger(__name__)
_SPEC_FIELDS = {"predictionCol": "prediction_col", "rawPredictionCol": "raw_prediction_col",
                "probabilityCol": "probability_col"}


class TorchModel(Model, EstimatorParams, TorchPersistence):
    """A trained model: ``transform`` appends predictions, ``evaluate`` computes the loss
    and metrics, ``predict_udf()`` is the model as a column function, ``torch_model()``
    returns the module.

    Args:
        creators: The estimator's creators (model, loss, metrics and config are used).
        checkpoint: The checkpoint the weights come from.

    The prediction column is a double for one output per row and ``array<float>`` for
    several. Classifiers (integer labels, several outputs) follow Spark ML's convention:
    ``predictionCol`` is the class index (double), ``rawPredictionCol`` the outputs
    (logits) and ``probabilityCol`` their softmax, both as Spark ML Vectors; an output
    Param set to ``""`` omits its column.

    Its Params are its estimator's (as a pyspark.ml model shares its estimator's Params
    class): the column Params that transform and evaluate read, and the others with the
    values the model was trained with (set by fit, see
    :func:`~spark_torch_est.params.base.carry_params`), which it saves and loads.
    """

    def __init__(self, creators: Creators | None = None, checkpoint: Checkpoint | None = None) -> None:
        super().__init__()  # the Params' defaults: see params/table.py
        self._creators = dataclasses.replace(creators, optimizer=None, scheduler=None, hooks={}) \
            if creators is not None else None
        self._checkpoint = checkpoint

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint this model was built from (``fit(resume_from=model)`` continues it).

        Raises:
            InvalidInputError: The model was made without one (``TorchModel()``).
        """
        if self._checkpoint is None:
            raise InvalidInputError(f"{self.uid} holds no checkpoint: a TorchModel comes from "
                                    "TorchEstimator.fit or TorchModel.load")
        return self._checkpoint

    @property
    def history(self) -> list[dict]:
        """Per-epoch metrics of the run up to this model."""
        return self.checkpoint.history

    def _made_by(self) -> Creators:
        """The creators that build the module, the loss and the metrics.

        Raises:
            InvalidInputError: The model was made without them (``TorchModel()``).
        """
        if self._creators is None:
            raise InvalidInputError(f"{self.uid} holds no creators: a TorchModel comes from "
                                    "TorchEstimator.fit or TorchModel.load")
        return self._creators

    def torch_model(self) -> torch.nn.Module:
        """The trained ``nn.Module`` on the CPU, in eval mode."""
        model = self._made_by().build_model()
        model.load_state_dict(self.checkpoint.model_state)
        return model.cpu().eval()

    def _scoring_spec(self, outputs: dict[str, str] | None = None, **fields: Any) -> ScoringSpec:
        """The spec of a scoring task; ``outputs`` maps output Params to the columns to emit."""
        weights = io.BytesIO()
        torch.save(self.checkpoint.model_state, weights)
        if outputs is not None:
            fields.update(output=self._output_kind(),
                          **{spec_field: outputs.get(param, "") for param, spec_field in _SPEC_FIELDS.items()})
        return ScoringSpec(key=hashlib.sha256(weights.getbuffer()).hexdigest(),
                           creators=cloudpickle.dumps(self._creators), weights=weights.getvalue(),
                           batch_size=self.getInferenceBatchSize(), precision=self.checkpoint.precision, **fields)

    def _output_kind(self) -> str:
        checkpoint = self.checkpoint
        width = 1
        for dim in checkpoint.output_shape:
            width *= dim
        if checkpoint.label_kind == "int" and width > 1:
            return "class"
        return "scalar" if width == 1 else "vector"

    def _inputs(self, dataset: DataFrame) -> dict[str, Any]:
        """Where the model's inputs are in ``dataset`` (read as they are, no copy), after
        checking them against the inputs the model was trained on.

        Raises:
            InvalidInputError: A column is missing, or its type differs from training, or
                this is Spark Connect before 4.0.
        """
        if is_remote():
            support.require(support.CONNECT_ML)
        trained = self.checkpoint.input_schema
        derived = input_schema(dataset.schema, features_col=self.getFeaturesCol(), feature_cols=self.getFeatureCols(),
                               input_cols=self.getInputCols(),
                               input_shapes={c.name: list(c.shape) for c in trained.columns if c.shape is not None}
                               if self.getInputCols() else None)
        check_inputs(dataset.schema, trained, derived)
        feature_cols = self.getFeatureCols()
        columns = tuple(feature_cols) if derived.layout == FEATURES_LAYOUT and feature_cols else tuple(derived.names)
        return {"schema": trained.to_dict(), "columns": columns}

    def _transform(self, dataset: DataFrame) -> DataFrame:
        types = _output_types(self._output_kind())
        outputs = {param: self.getOrDefault(param) for param in types if self.getOrDefault(param)}
        if not outputs:
            logger.warning("%s.transform() does nothing: its output column Params are empty", self.uid)
            return dataset
        for param, name in outputs.items():
            if name in dataset.columns:
                raise InvalidInputError(f"the DataFrame already has a column {name!r}; set {param} to another name")
        where = self._inputs(dataset)
        schema = T.StructType(list(dataset.schema.fields) +
                              [T.StructField(name, types[param], False) for param, name in outputs.items()])
        return self._map_in_arrow(dataset, predict_task(self._scoring_spec(outputs, **where)), schema)

    def _map_in_arrow(self, dataset: DataFrame, task: Callable, schema: T.StructType | str,
                      collected: bool = False) -> DataFrame:
        """``dataset.mapInArrow(task, schema)``; with ``directRead``, a plain Parquet table
        whose columns pyarrow reads exactly as Spark would pass them (see sources.py) is
        read by the tasks themselves, without the JVM's scan and row-to-Arrow conversion.

        The tasks run over ``spark.range`` of the table's rows, so Spark knows the row count
        but takes the result to be 8 bytes a row. A result that is not ``collected`` at once
        may meet a join, so it reads the files only where that size leads Spark to the same
        broadcast decision as the table's own (else a join could broadcast a table far
        bigger than Spark believes).
        """
        if self.getDirectRead():
            spark = dataset.sparkSession
            try:
                slots = spark.sparkContext.defaultParallelism
            except Exception:  # Spark Connect: Spark reads the table
                slots = 0
            source = parquet_table(dataset, slots) if slots else None
            if source is not None:
                parts, rows = len(source.parts), sum(source.part_rows)
                if collected or _same_broadcast(spark, dataset, estimated_bytes=8 * rows):
                    logger.info("%s reads %d rows in %d parts of the Parquet files directly", self.uid, rows, parts)
                    return spark.range(0, rows, 1, parts).mapInArrow(over_parts(source, task), schema)
                logger.info("%s scores the table through Spark's scan: a join would take its result for %d bytes",
                            self.uid, 8 * rows)
        return dataset.mapInArrow(task, schema)

    def predict_udf(self, output: str = "prediction", as_array: bool = False) -> Any:
        """The model as a batched column function, for ``withColumn``, ``select`` and SQL.

        In the spirit of ``pyspark.ml.functions.predict_batch_udf``: an Arrow UDF that scores
        whole Arrow batches (``inferenceBatchSize`` rows per forward pass) with the model
        ``transform`` uses, built once per Python worker and shared with ``transform``. Call
        it with the feature columns: one Vector, ``array<numeric>`` or numeric column, or,
        for a ``featureCols`` model, its numeric columns in that order::

            predict = model.predict_udf()
            df.withColumn("prediction", predict("features"))
            spark.udf.register("predict", predict)
            spark.sql("SELECT predict(f0, f1, f2) FROM t")

        Args:
            output: ``"prediction"`` (default): the values of ``transform``'s predictionCol,
                a double (one output, or a classifier's class index) or ``array<float>``
                (several outputs). Classifiers also offer ``"rawPrediction"`` (the logits)
                and ``"probability"`` (their softmax), as Spark ML Vectors.
            as_array: Give ``"rawPrediction"`` and ``"probability"`` as ``array<double>``
                instead of Vectors, which SQL can index (``p[1]``) and SQL has no
                ``vector_to_array`` for (default False).

        Raises:
            InvalidInputError: ``output`` is not one this model has.
            InvalidInputError: pyspark is older than 4.1 (it has no Arrow UDFs); use ``transform``.
        """
        types = _output_types(self._output_kind())
        param = f"{output}Col"
        if param not in types:
            offered = ", ".join(repr(p[:-len("Col")]) for p in types)
            raise InvalidInputError(f"predict_udf(output={output!r}): this model offers {offered}")
        support.require(support.PREDICT_UDF)
        from pyspark.sql.functions import arrow_udf
        spec = self._scoring_spec({param: output}, schema=self.checkpoint.input_schema.to_dict(),
                                  columns=self._argument_names())
        vector = types[param] == VectorUDT()
        # pyspark's stub wants functionType with a function; at run time Arrow UDFs take the
        # kind from the function's type hints, as here
        return arrow_udf(arrow_predict_function(spec, as_array and vector),  # type: ignore[call-overload]
                         T.ArrayType(T.DoubleType()) if as_array and vector else types[param])

    def _argument_names(self) -> tuple[str, ...]:
        """What predict_udf's arguments are: the model's input columns, in order."""
        input_cols, feature_cols, features_col = self.getInputCols(), self.getFeatureCols(), self.getFeaturesCol()
        if input_cols:
            return tuple(input_cols)
        if feature_cols:
            return tuple(feature_cols)
        if features_col is None:  # training refused a model without inputs
            raise InvalidInputError(f"{self.uid} has no input columns: set featuresCol, featureCols or inputCols")
        return (features_col,)

    def evaluate(self, dataset: DataFrame) -> dict[str, float]:
        """The loss and metrics over every row of ``dataset``, computed by Spark tasks.

        For a LightningModule: what ``pl.Trainer.validate`` returns for those rows, each value
        its ``validation_step`` logs (``(features, label)`` batches of ``inferenceBatchSize``
        rows, as in training) averaged over the rows; Lightning's Trainer runs it in each task
        and the partitions' values are weighed by their rows.

        Returns:
            ``{"loss": ..., "<metric name>": ...}``: weighted by rows, exact for losses
            and metrics that are means over rows; stateful metrics (torchmetrics) are
            merged with their ``merge_state``. For a LightningModule:
            ``{"<logged name>": ...}``.

        Raises:
            InvalidInputError: Missing or unusable columns (before any Spark job), or a
                LightningModule without a ``validation_step``.
        """
        lightning = self.checkpoint.lightning_state is not None
        if lightning:
            creators = self._made_by()
            module = creators.model if isinstance(creators.model, torch.nn.Module) else creators.build_model()
            if not defines(module, "validation_step"):
                raise InvalidInputError(
                    f"evaluate() runs the LightningModule's validation_step, which {type(module).__name__} does not "
                    "define: define it (as for pl.Trainer.validate), or score the rows with transform() and a "
                    "pyspark.ml evaluator")
        where = self._inputs(dataset)
        label_kind(dataset.schema, self.getLabelCol())
        weight = self.getWeightCol()
        needed = list(dict.fromkeys([*where["columns"], self.getLabelCol(), *([weight] if weight else [])]))
        if weight:
            weight_column(dataset, weight)
        frame = dataset.select(*needed)
        spec = self._scoring_spec(label_col=self.getLabelCol(), weight_col=weight, **where)
        if lightning:
            partitions = self._map_in_arrow(frame, validate_task(spec), VALIDATION_SCHEMA, collected=True)
            return validated(partitions.collect())
        rows = self._map_in_arrow(frame, evaluate_task(spec), EVALUATION_SCHEMA, collected=True).collect()
        totals = torch.tensor([r["totals"] for r in rows], dtype=torch.float64).sum(dim=0)
        if not rows or totals[0] == 0:
            raise InvalidInputError("evaluate() got a DataFrame without rows (or, with weightCol, whose weights are "
                                    "all 0)")
        creators = self._made_by()
        accumulator = MetricAccumulator(Loss(creators.build_loss()), creators.metrics, torch.device("cpu"))
        for i, name in enumerate(accumulator.names):
            for row in rows:
                if row["totals"][0] and row["metric_states"][i]:
                    try:
                        accumulator.merge(name, bytes(row["metric_states"][i]))
                    except TypeError as error:
                        raise InvalidInputError(str(error)) from None
        return accumulator.results(totals)

    # ---------------------------------------------------------------- persistence

    def _persisted_files(self, folder: str) -> dict[str, bytes]:
        """The creators (model, loss, metrics and config, cloudpickled; a model keeps no
        optimizer or hooks) and the checkpoint, with a copy of its sharded state in
        ``folder`` under "fsdp", so that the saved model can be continued on its own (see
        persistence.py)."""
        return {"creators.pkl": cloudpickle.dumps(self._creators),
                "checkpoint.pt": saved_checkpoint(self.checkpoint, folder)}

    @classmethod
    def _from_files(cls, read: Callable[[str], bytes | None], folder: str) -> TorchModel:
        return cls(creators=moved.loads(read_required(read, "creators.pkl", folder), f"{folder}/creators.pkl"),
                   checkpoint=loaded_checkpoint(read_required(read, "checkpoint.pt", folder), folder))


def _output_types(kind: str) -> dict[str, T.DataType]:
    """Output Param -> Spark type of its column, for a model whose output is ``kind``."""
    if kind == "class":
        return {"predictionCol": T.DoubleType(), "rawPredictionCol": VectorUDT(), "probabilityCol": VectorUDT()}
    return {"predictionCol": T.DoubleType() if kind == "scalar" else T.ArrayType(T.FloatType())}


def _same_broadcast(spark: SparkSession, dataset: DataFrame, estimated_bytes: int) -> bool:
    """Whether Spark would decide alike whether to broadcast ``dataset`` and a plan it takes
    for ``estimated_bytes``, under ``spark.sql.autoBroadcastJoinThreshold``."""
    threshold = jvm.broadcast_threshold(spark)
    if threshold < 0:  # no broadcast joins
        return True
    return (estimated_bytes <= threshold) == (jvm.plan_size_bytes(dataset) <= threshold)
