"""Train a classifier with TorchEstimator, score it with Spark's own evaluators, tune it with
CrossValidator, and score new rows with predict_udf in SQL.

Integer labels and a model with one output per class make a classifier: ``transform``
adds ``rawPrediction`` (logits) and ``probability`` (softmax) as Spark ML Vectors and the
class index as ``prediction``, the columns Spark's evaluators read.

Runs with `python examples/train_classifier.py` (under a minute on local[2]) and with
`spark-submit examples/train_classifier.py`.
"""

from __future__ import annotations

import os
import sys
from typing import cast

import torch
from pyspark.ml import Pipeline
from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator
from pyspark.ml.feature import VectorAssembler
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_torch_est import TorchEstimator, TorchModel

# Executors must run a Python that has torch; by default the one running this script.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
FEATURES = [f"x{i}" for i in range(6)]


def make_model(config: dict) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(len(FEATURES), config["hidden"]), torch.nn.ReLU(),
                               torch.nn.Linear(config["hidden"], 2))  # two classes: two logits


def make_optimizer(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=config["lr"])


def make_data(spark: SparkSession, rows: int = 4000):
    """Six numeric columns; the label (an integer: a class index) is 1 inside a noisy circle."""
    df = spark.range(rows).select(*[F.randn(seed=i).alias(name) for i, name in enumerate(FEATURES)])
    radius = F.col("x0") ** 2 + F.col("x1") ** 2 + 0.2 * F.randn(seed=99)
    return df.withColumn("label", (radius < 1.4).cast("int"))


def main() -> None:
    # local[*] unless spark-submit --master or conf/spark-defaults.conf names another master
    spark = SparkSession.builder.appName("spark_torch_est classifier example").getOrCreate()
    train, test = make_data(spark).randomSplit([0.8, 0.2], seed=1)
    train, test = train.cache(), test.cache()

    assembler = VectorAssembler(inputCols=FEATURES, outputCol="features")
    est = TorchEstimator(model=make_model, optimizer=make_optimizer, loss=torch.nn.CrossEntropyLoss(),
                         config={"hidden": 32, "lr": 0.02}, batchSize=32, maxEpochs=3,
                         numWorkers=min(2, spark.sparkContext.defaultParallelism), showProgress=False)
    model = Pipeline(stages=[assembler, est]).fit(train)
    scored = model.transform(test)
    scored.select("label", "prediction", "rawPrediction", "probability").show(3, truncate=False)

    auc = BinaryClassificationEvaluator(metricName="areaUnderROC").evaluate(scored)
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    log_loss = MulticlassClassificationEvaluator(metricName="logLoss").evaluate(scored)  # type: ignore[arg-type]
    print(f"test AUC {auc:.3f}  accuracy {accuracy:.3f}  log loss {log_loss:.3f}")

    # Tune the batch size; each grid point and fold trains a new run.
    grid = ParamGridBuilder().addGrid(est.batchSize, [32, 256]).build()
    cv = CrossValidator(estimator=Pipeline(stages=[assembler, est]), estimatorParamMaps=grid, numFolds=2, seed=7,
                        evaluator=BinaryClassificationEvaluator(metricName="areaUnderROC"))
    tuned = cv.fit(train)
    for params, metric in zip(grid, tuned.avgMetrics):
        print("  " + ", ".join(f"{p.name}={v}" for p, v in params.items()) + f": cross-validated AUC {metric:.3f}")
    best_auc = BinaryClassificationEvaluator().evaluate(tuned.transform(test))
    print(f"best model: test AUC {best_auc:.3f}")

    # The fitted model as a SQL function: one Vector column in, the class probabilities out.
    trained = cast(TorchModel, model.stages[1])  # a PipelineModel's stages are typed as Transformers
    spark.udf.register("circle_probability", trained.predict_udf("probability"))
    assembler.transform(test).createOrReplaceTempView("points")
    spark.sql("SELECT label, circle_probability(features) AS probability FROM points LIMIT 3").show(truncate=False)
    spark.stop()


if __name__ == "__main__":
    main()
