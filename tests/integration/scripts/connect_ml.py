"""Run by test_connect.py: the Spark ML contract from a Spark Connect session (local server):
every feature layout, a classifier with Spark's evaluators, CrossValidator, config tuned by
TrainValidationSplit and SuccessiveHalving, predict_udf,
and save/load of models, estimators and pipelines. Prints one RESULT line of JSON."""

import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from pyspark.ml import Pipeline, PipelineModel  # noqa: E402
from pyspark.ml.evaluation import (  # noqa: E402
    BinaryClassificationEvaluator,
    MulticlassClassificationEvaluator,
    RegressionEvaluator,
)
from pyspark.ml.feature import VectorAssembler  # noqa: E402
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder, TrainValidationSplit  # noqa: E402

from spark_torch_est import TorchEstimator, TorchModel  # noqa: E402
from spark_torch_est.tuning import SuccessiveHalving  # noqa: E402
from tests.helpers import FEATURE_LAYOUTS, layout_data, layout_frame, linear_model, sgd  # noqa: E402

started = time.monotonic()
spark = SparkSession.builder.remote("local[2]").getOrCreate()
result = {"session": type(spark).__module__, "layouts": {}}
directory = tempfile.mkdtemp()


def _predictions(df, column="prediction"):
    return np.array([r[column] for r in df.orderBy("id").select(column).collect()])


for layout in FEATURE_LAYOUTS:
    width = 1 if layout == "numeric" else 8
    x, y = layout_data(width)
    df, params = layout_frame(spark, layout, x, y)
    model = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), config={"in_features": width},
                           maxEpochs=1, showProgress=False, **params).fit(df)
    expected = model.torch_model()(torch.tensor(x, dtype=torch.float32)).detach().numpy().ravel()
    result["layouts"][layout] = {
        "prediction_error": float(np.abs(_predictions(model.transform(df)) - expected).max()),
        "evaluate_error": abs(model.evaluate(df)["loss"] - float(np.mean((expected - y) ** 2))),
    }

# Typed inputs: an int64 id beside an array of floats and a ragged token array, model(*inputs).
class Typed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)
        self.tokens = torch.nn.Embedding(10, 1, padding_idx=0)

    def forward(self, row_id, features, tokens):
        return self.linear(features) + (row_id % 2).float().unsqueeze(1) + self.tokens(tokens).sum(1)


x, y = layout_data(8)
typed_rows = [(i, r.tolist(), list(range(1, 1 + i % 4)), float(t)) for i, (r, t) in enumerate(zip(x, y))]
typed = spark.createDataFrame(typed_rows, "id long, features array<double>, tokens array<int>, label double")
typed_model = TorchEstimator(model=lambda c: Typed(), optimizer=sgd, loss=torch.nn.MSELoss(),
                             inputCols=["id", "features", "tokens"], maxEpochs=1, showProgress=False).fit(typed)
module = typed_model.torch_model()
expected = np.array([float(module(torch.tensor([i]), torch.tensor([f], dtype=torch.float32),
                                  torch.tensor([t or [0]]))) for i, f, t, _ in typed_rows])
typed.write.parquet(os.path.join(directory, "typed"))
typed_table = spark.read.parquet(os.path.join(directory, "typed"))  # a plain Parquet table: Spark reads it here
result["typed"] = {
    "prediction_error": float(np.abs(_predictions(typed_model.transform(typed)) - expected).max()),
    "evaluate_error": abs(typed_model.evaluate(typed)["loss"] - float(np.mean((expected - y) ** 2))),
    "table_prediction_error": float(np.abs(_predictions(typed_model.transform(typed_table)) - expected).max()),
    "table_evaluate_error": abs(typed_model.evaluate(typed_table)["loss"] - float(np.mean((expected - y) ** 2))),
}

# A classifier on featureCols through a Pipeline, scored by Spark's evaluators and tuned by CrossValidator.
rng = np.random.default_rng(0)
x = rng.normal(size=(600, 4))
names = ["f0", "f1", "f2", "f3"]
df = spark.createDataFrame([(i, *map(float, r), int(r[0] + r[1] > 0)) for i, r in enumerate(x)],
                           ["id", *names, "label"])
est = TorchEstimator(model=lambda c: torch.nn.Linear(4, 2),
                     optimizer=lambda m, c: torch.optim.Adam(m.parameters(), lr=0.05),
                     loss=torch.nn.CrossEntropyLoss(), maxEpochs=2, showProgress=False)
pipeline = Pipeline(stages=[VectorAssembler(inputCols=names, outputCol="features"), est])
fitted = pipeline.fit(df)
scored = fitted.transform(df)
classifier = fitted.stages[1]
assembled = fitted.stages[0].transform(df)
result["classifier"] = {
    "types": {f.name: f.dataType.simpleString() for f in scored.schema.fields},
    "auc": BinaryClassificationEvaluator().evaluate(scored),
    "log_loss": MulticlassClassificationEvaluator(metricName="logLoss").evaluate(scored),
    "evaluate_loss": classifier.evaluate(assembled)["loss"],
    "udf_equals_transform": bool((_predictions(assembled.withColumn("u", classifier.predict_udf("probability")(
        "features")), "u") == _predictions(scored, "probability")).all()),
}
grid = ParamGridBuilder().addGrid(est.maxEpochs, [1, 3]).build()
cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=1,
                    evaluator=MulticlassClassificationEvaluator(metricName="logLoss")).fit(assembled)
result["cross_validator"] = {"metrics": list(map(float, cv.avgMetrics)),
                             "best_epochs": cv.bestModel.checkpoint.progress.epoch}

# config tuned by ParamGridBuilder: TrainValidationSplit and SuccessiveHalving over learning rates.
x, y = layout_data(8)
linear, params = layout_frame(spark, "array_double", x, y)
regression = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), maxEpochs=2, seed=3,
                            showProgress=False, **params)
config_grid = ParamGridBuilder().addGrid(regression.getParam("config"), [{"lr": 0.0}, {"lr": 0.05}]).build()
tvs = TrainValidationSplit(estimator=regression, estimatorParamMaps=config_grid, seed=3,
                           evaluator=RegressionEvaluator()).fit(linear)
halving = SuccessiveHalving(estimator=regression, estimatorParamMaps=config_grid, seed=3, parallelism=2,
                            evaluator=RegressionEvaluator()).fit(linear)
result["config_tuning"] = {"tvs_metrics": list(map(float, tvs.validationMetrics)), "rungs": halving.rungs,
                           "best_epochs": halving.bestModel.checkpoint.progress.epoch,
                           "best_predicts": len(halving.transform(linear).select("prediction").collect())}

# save and load: a model (twice, the second with overwrite), an estimator with its run, a PipelineModel.
classifier.save(f"{directory}/model")
classifier.write().overwrite().save(f"{directory}/model")
loaded = TorchModel.load(f"{directory}/model")
est.save(f"{directory}/estimator")
loaded_est = TorchEstimator.load(f"{directory}/estimator")
fitted.write().overwrite().save(f"{directory}/pipeline")
result["persistence"] = {
    "model_equal": bool((_predictions(loaded.transform(assembled)) == _predictions(scored)).all()),
    "estimator_progress": [loaded_est.progress.epoch, est.progress.epoch],
    "estimator_continues": loaded_est.setMaxEpochs(3).fit(assembled).checkpoint.progress.epoch,
    "pipeline_equal": bool((_predictions(PipelineModel.load(f"{directory}/pipeline").transform(df), "probability")
                            == _predictions(scored, "probability")).all()),
}
result["seconds"] = time.monotonic() - started
print("RESULT " + json.dumps(result))
spark.stop()
