"""Tune learning rate and width with Optuna: a TPE sampler picks each trial's values, a
median pruner stops a trial whose validation loss after an epoch is worse than the median
of the trials before it at that epoch, and two trials train at once on one SparkSession
(`n_jobs=2`, one rank each). Each trial is an MLflow child run of the study's run: at
MLFLOW_TRACKING_URI when it is set, else in a local store in a temporary folder.

Runs with `python examples/optuna_tune.py` (local[*] from conf/ or the default) and with
`spark-submit [--master ...] examples/optuna_tune.py`. Needs `pip install
'spark-torch-est[optuna,mlflow]'`.
"""

from __future__ import annotations

import os
import sys
import tempfile

import cloudpickle
import mlflow
import optuna
import torch
import train_regression  # the model, optimizer and data of examples/train_regression.py
from mlflow import MlflowClient
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_torch_est import MLflowLogger, TorchEstimator, TorchModel
from spark_torch_est.tuning import OptunaPruning

# Executors must run a Python that has torch; by default the one running this script.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
# The creators come from our own module, which the executors do not have: ship them by value.
cloudpickle.register_pickle_by_value(train_regression)

EXPERIMENT = "optuna_tune"
TRIALS = 6
MAX_EPOCHS = 4


def tracking_experiment() -> str:
    """Points MLflow at MLFLOW_TRACKING_URI, or at a new local store; returns the experiment's id."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        folder = tempfile.mkdtemp(prefix="spark_torch_est-optuna-")
        mlflow.set_tracking_uri(f"sqlite:///{folder}/mlflow.db")
        MlflowClient().create_experiment(EXPERIMENT, artifact_location=os.path.join(folder, "artifacts"))
    return mlflow.set_experiment(EXPERIMENT).experiment_id


def main() -> None:
    spark = SparkSession.builder.appName("spark_torch_est optuna example").getOrCreate()
    df = train_regression.make_data(spark, rows=10_000).withColumn("is_val", F.rand(seed=2) < 0.2).cache()
    train, test = df.randomSplit([0.9, 0.1], seed=1)
    experiment_id = tracking_experiment()
    models: dict[int, TorchModel] = {}

    def objective(trial: optuna.Trial) -> float:
        config = {"features": 16, "hidden": trial.suggest_categorical("hidden", [8, 32, 64]),
                  "lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True)}
        est = TorchEstimator(
            model=train_regression.make_model, optimizer=train_regression.make_optimizer, loss=torch.nn.MSELoss(),
            config=config, batchSize=128, maxEpochs=MAX_EPOCHS, numWorkers=1, seed=0,
            validationIndicatorCol="is_val", showProgress=False,
            loggers=[MLflowLogger(experiment_name=EXPERIMENT, run_name=f"trial {trial.number}", log_model=False),
                     OptunaPruning(trial, monitor="val_loss")],
        )
        models[trial.number] = est.fit(train)  # raises optuna.TrialPruned when the pruner stops it
        return est.history[-1]["val_loss"]

    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
    with mlflow.start_run(run_name="optuna study") as parent:
        study.optimize(objective, n_trials=TRIALS, n_jobs=2)

    print(f"\n{len(study.trials)} trials of up to {MAX_EPOCHS} epochs, two at a time:")
    for trial in study.trials:
        epochs = max(trial.intermediate_values, default=0)
        print(f"  trial {trial.number} (hidden {trial.params['hidden']:>2}, lr {trial.params['lr']:.1e}): "
              f"{trial.state.name.lower()} after {epochs} of {MAX_EPOCHS} epochs, "
              f"val_loss {trial.intermediate_values.get(epochs, 0):.4f}")
    best = study.best_trial
    print(f"best: trial {best.number} {best.params}, val_loss {best.value:.4f}, "
          f"test RMSE {rmse(models[best.number], test):.4f}")
    children = MlflowClient().search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    print(f"MLflow: {len(children)} child runs of the study's run {parent.info.run_id} at {mlflow.get_tracking_uri()}")
    spark.stop()


def rmse(model: TorchModel, test: DataFrame) -> float:
    """The model's root mean squared error on ``test``."""
    scored = model.transform(test)
    return float(scored.select(F.sqrt(F.avg((F.col("label") - F.col("prediction")) ** 2))).collect()[0][0])


if __name__ == "__main__":
    main()
