"""Successive halving on exact resume: kept configurations continue their runs, the winner
is a straight fit of its map, decisions follow the evaluator, bad settings fail before any job."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator, RegressionEvaluator
from pyspark.ml.tuning import ParamGridBuilder
from pyspark.sql import functions as F

from spark_torch_est import Logger
from spark_torch_est.errors import InvalidInputError, TrainingFailedError
from spark_torch_est.tuning import SuccessiveHalving, SuccessiveHalvingModel, param_map_name
from tests.helpers import flat_weights, linear_estimator, mlp, spark_jobs_started

pytestmark = pytest.mark.spark



class EpochsSeen(Logger):
    """Records every completed epoch of every run (the list is shared by the tuner's copies)."""

    seen: list = []

    def on_epoch_end(self, metrics, run_id):
        EpochsSeen.seen.append((run_id, int(metrics["epoch"])))


@pytest.fixture(scope="module")
def split_df(linear_df):
    """The linear data with a fixed quarter of validation rows, cached."""
    return linear_df.limit(1200).withColumn("is_val", F.rand(seed=4) < 0.25).cache()


def _tuner(est, grid, **params) -> SuccessiveHalving:
    settings = dict(estimator=est, estimatorParamMaps=grid, evaluator=RegressionEvaluator(metricName="rmse"), eta=2,
                    minDuration="1ep")
    settings.update(params)
    return SuccessiveHalving(**settings)


def test_survivors_continue_their_runs_and_the_winner_is_a_straight_fit_of_its_map(spark, split_df):
    EpochsSeen.seen = []
    est = linear_estimator(model=mlp, maxEpochs=4, seed=3, validationIndicatorCol="is_val", loggers=[EpochsSeen()])
    grid = ParamGridBuilder().addGrid(est.getParam("config"),
                                      [{"lr": 0.0}, {"lr": 0.002}, {"lr": 0.05}, {"lr": 0.02}]).build()
    tuned = _tuner(est, grid).fit(split_df)

    assert len(EpochsSeen.seen) == 8  # 4 maps x 1 epoch, 2 x 1 more, the winner 2 more: not 12 or 16
    runs = {run for run, _ in EpochsSeen.seen}
    assert all(sorted(e for r, e in EpochsSeen.seen if r == run) == list(range(1, 1 + sum(
        r == run for r, _ in EpochsSeen.seen))) for run in runs)  # every run trained each epoch once
    assert [(r["rung"], r["index"], r["epochs"], r["kept"]) for r in tuned.rungs] == [
        (0, 0, 1, False), (0, 1, 1, False), (0, 2, 1, True), (0, 3, 1, True),
        (1, 2, 2, True), (1, 3, 2, False), (2, 2, 4, True)]
    assert tuned.validationMetrics[2] == min(tuned.validationMetrics) == tuned.rungs[-1]["metric"]
    assert est.checkpoint is None and est.getConfig() == {}  # the estimator's own run is left alone

    straight = est.copy(grid[2]).fit(split_df)
    assert straight.history == tuned.bestModel.history
    np.testing.assert_array_equal(flat_weights(straight), flat_weights(tuned.bestModel))
    assert tuned.bestModel.checkpoint.progress == straight.checkpoint.progress


def test_larger_is_better_evaluators_keep_the_largest_and_ties_go_to_the_earlier_map(spark, split_df):
    est = linear_estimator(maxEpochs=2, seed=3, validationIndicatorCol="is_val")
    grid = ParamGridBuilder().addGrid(est.config, [{"lr": 0.05}, {"lr": 0.0}, {"lr": 0.05}]).build()
    r2 = RegressionEvaluator(labelCol="label", predictionCol="prediction", metricName="r2")
    tuned = _tuner(est, grid, evaluator=r2).fit(split_df)
    rung0 = [r for r in tuned.rungs if r["rung"] == 0]
    assert rung0[0]["metric"] == rung0[2]["metric"] > rung0[1]["metric"]  # maps 0 and 2 are the same
    assert [r["kept"] for r in rung0] == [True, False, True]
    assert [(r["index"], r["kept"]) for r in tuned.rungs if r["rung"] == 1] == [(0, True), (2, False)]  # a tie
    assert tuned.bestModel.checkpoint.progress.epoch == 2


@pytest.mark.slow
def test_parallelism_gives_the_same_decisions_and_the_split_is_seeded(spark, linear_df):
    est = linear_estimator(maxEpochs=2, numWorkers=1, seed=3)
    grid = ParamGridBuilder().addGrid(est.config, [{"lr": 0.001}, {"lr": 0.05}, {"lr": 0.0}, {"lr": 0.01}]).build()
    one = _tuner(est, grid, parallelism=1, seed=7, trainRatio=0.7).fit(linear_df)
    two = _tuner(est, grid, parallelism=2, seed=7, trainRatio=0.7).fit(linear_df)
    assert one.rungs == two.rungs and one.validationMetrics == two.validationMetrics
    assert [r["index"] for r in one.rungs if r["kept"] and r["rung"] == 1] == [1]
    np.testing.assert_array_equal(flat_weights(one.bestModel), flat_weights(two.bestModel))


def test_maps_may_vary_batch_size_workers_and_max_epochs_and_the_model_saves(spark, split_df, tmp_path):
    est = linear_estimator(seed=3, validationIndicatorCol="is_val", config={"lr": 0.05})
    grid = [{est.batchSize: 32, est.numWorkers: 1, est.maxEpochs: 3},
            {est.batchSize: 64, est.numWorkers: 2, est.maxEpochs: 2},
            {est.batchSize: 128, est.numWorkers: 2, est.maxEpochs: 1, est.config: {"lr": 0.0}}]
    tuned = _tuner(est, grid).fit(split_df)
    winner = tuned.rungs[-1]["index"]
    assert tuned.rungs[-1]["epochs"] == grid[winner][est.maxEpochs]
    assert tuned.bestModel.checkpoint.progress.epoch == grid[winner][est.maxEpochs]
    assert [r["kept"] for r in tuned.rungs if r["rung"] == 0][2] is False  # lr 0 learns nothing

    tuned.save(str(tmp_path / "tuned"))
    loaded = SuccessiveHalvingModel.load(str(tmp_path / "tuned"))
    assert loaded.rungs == tuned.rungs and loaded.validationMetrics == tuned.validationMetrics
    expected = [r.prediction for r in tuned.transform(split_df).collect()]
    assert [r.prediction for r in loaded.transform(split_df).collect()] == expected


def test_a_failing_map_is_recorded_ranked_last_and_the_search_goes_on(spark, split_df):
    est = linear_estimator(maxEpochs=2, seed=3, validationIndicatorCol="is_val")
    grid = ParamGridBuilder().addGrid(est.config, [{"lr": 0.05}, {"lr": -1.0}, {"lr": 0.02}, {"lr": 1e30}]).build()
    tuned = _tuner(est, grid).fit(split_df)  # map 1: SGD refuses it; map 3: its loss overflows

    rung0 = {r["index"]: r for r in tuned.rungs if r["rung"] == 0}
    assert "Invalid learning rate" in rung0[1]["error"] and "loss" in rung0[3]["error"].lower()
    assert not rung0[1]["kept"] and not rung0[3]["kept"] and rung0[0]["kept"] and rung0[2]["kept"]
    assert "error" not in rung0[0] and "error" not in rung0[2]
    assert all(r["index"] in (0, 2) for r in tuned.rungs if r["rung"] > 0)
    nan = [i for i, m in enumerate(tuned.validationMetrics) if m != m]
    assert nan == [1, 3] and tuned.bestModel.checkpoint.progress.epoch == 2


def test_only_when_every_map_fails_does_the_search_fail_naming_each(spark, split_df):
    est = linear_estimator(maxEpochs=2, validationIndicatorCol="is_val")
    grid = ParamGridBuilder().addGrid(est.config, [{"lr": -1.0}, {"lr": -2.0}]).build()
    with pytest.raises(TrainingFailedError, match=r"every param map failed: map 0 \(config=\{'lr': -1.0\}\): .*"
                                                  r"Invalid learning rate.*map 1 .*-2.0"):
        _tuner(est, grid).fit(split_df)


@pytest.mark.parametrize("params, message", [
    ({"eta": 1}, "eta must be at least 2 .*got 1"),
    ({"minDuration": "0ep"}, "minDuration must look like .*got '0ep'"),
    ({"minDuration": "3ep"}, "minDuration='3ep' is past maxEpochs=2 of param map 0 \\(maxEpochs=2\\)"),
    ({"minDuration": "100ba"}, "minDuration counts epochs"),
    ({"evaluator": lambda: RegressionEvaluator(predictionCol="p")}, "reads predictionCol='p', but the model "
                                                                    "writes predictionCol='prediction'"),
    ({"evaluator": lambda: MulticlassClassificationEvaluator(metricName="logLoss")},
     "reads probabilityCol='probability', but the model writes no probabilityCol"),
    ({"evaluator": lambda: RegressionEvaluator(labelCol="y")}, "reads labelCol='y', which the DataFrame does not have"),
    ({"parallelism": 2}, "parallelism=2 trains 2 configurations at once with numWorkers 2 \\+ 2 = 4 ranks"),
    ({"trainRatio": 1.0}, "trainRatio must be between 0 and 1 .*got 1.0"),
])
def test_bad_settings_are_refused_before_any_job_by_name(spark, linear_df, params, message):
    est = linear_estimator(probabilityCol="")
    grid = [{est.maxEpochs: 2}, {est.maxEpochs: 4}]
    params = {name: value() if callable(value) else value for name, value in params.items()}
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match=message):
        _tuner(est, grid, **params).fit(linear_df)
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None


def test_an_evaluator_reading_one_number_per_row_is_refused_for_several_labels(spark, linear_df):
    df = linear_df.withColumn("pair", F.array("label", "label"))
    est = linear_estimator(labelCol="pair")
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match="labelCol='pair' holds several numbers per row"):
        _tuner(est, [{est.maxEpochs: 2}], evaluator=RegressionEvaluator(labelCol="pair")).fit(df)
    assert spark_jobs_started(spark) == jobs


def test_param_maps_have_readable_names():
    est = linear_estimator()
    assert param_map_name({est.batchSize: 32, est.config: {"lr": 0.01}}) == "batchSize=32, config={'lr': 0.01}"
    assert param_map_name({}) == "defaults"


def test_each_configuration_is_one_mlflow_run_named_after_its_map_under_the_tuner_run(
        spark, split_df, store, monkeypatch):
    import mlflow

    from spark_torch_est import MLflowLogger

    uri, client, experiment_id = store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tests")
    est = linear_estimator(maxEpochs=2, seed=3, validationIndicatorCol="is_val",
                           loggers=[MLflowLogger(log_model=False)])
    grid = ParamGridBuilder().addGrid(est.config, [{"lr": 0.0}, {"lr": 0.05}]).build()
    with mlflow.start_run(run_name="search") as outer:
        _tuner(est, grid).fit(split_df)
    (tuner,) = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{outer.info.run_id}'")
    assert tuner.info.status == "FINISHED" and tuner.data.params["eta"] == "2"
    children = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{tuner.info.run_id}'")
    epochs = {c.info.run_name: sorted(m.step for m in client.get_metric_history(c.info.run_id, "train_loss"))
              for c in children}
    assert epochs == {param_map_name(grid[0]): [1], param_map_name(grid[1]): [1, 2]}  # one run across the rungs
    assert all(c.info.status == "FINISHED" for c in children) and len(children) == 2
    assert est.loggers[0].run_name is None  # the estimator's own logger is left as it was


# ------------------------------------------------------------------ Optuna with pruning


def test_a_pruned_trial_stops_at_an_epoch_end_on_every_rank_keeps_that_checkpoint_and_raises_trial_pruned(
        spark, split_df):
    optuna = pytest.importorskip("optuna")
    from spark_torch_est.tuning import OptunaPruning

    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=0.0, n_warmup_steps=2))
    fitted, raised = [], []

    def objective(trial):
        est = linear_estimator(maxEpochs=5, seed=3, validationIndicatorCol="is_val", loggers=[OptunaPruning(trial)])
        fitted.append(est)
        try:
            est.fit(split_df)  # 2 ranks: both must stop at the same epoch end, or the fit hangs
        except optuna.TrialPruned as error:
            raised.append(error)
            raise
        return est.history[-1]["val_loss"]

    study.optimize(objective, n_trials=1)
    (trial,), (est,), (error,) = study.trials, fitted, raised
    assert trial.state == optuna.trial.TrialState.PRUNED and "pruned after epoch 2 (val_loss=" in str(error)
    assert est.progress.epoch == 2 and est.progress.batch_in_epoch == 0  # 2 of its 5 epochs, no half epoch
    assert est.checkpoint.progress == est.progress and [h["epoch"] for h in est.history] == [1, 2]
    assert trial.intermediate_values == {h["epoch"]: h["val_loss"] for h in est.history}
    est.setLoggers([])
    est.fit(split_df, duration="1ep")  # the kept checkpoint continues the run
    assert est.progress.epoch == 3


def test_a_logger_that_does_not_answer_in_time_does_not_hold_up_the_fit(spark, split_df, caplog):
    import logging
    import threading

    release = threading.Event()

    class Stuck(Logger):
        event_timeout_s = 0.5

        def should_stop(self, metrics):
            release.wait(60)
            return True

    est = linear_estimator(maxEpochs=2, seed=3, numWorkers=1, loggers=[Stuck()])
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch_est.loggers.dispatch"):
            est.fit(split_df)
    finally:
        release.set()
    assert est.progress.epoch == 2  # its answer never came: the fit went on to its end
    assert "logger Stuck did not return from should_stop within its event_timeout_s (0.5 s)" in caplog.text


class StopAtEpoch(Logger):
    """Asks the fit to stop at the end of epoch ``epoch``; rank 0 waits at most 2 s for it."""

    event_timeout_s = 1.0

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def should_stop(self, metrics):
        return metrics["epoch"] >= self.epoch


class SlowTracker(Logger):
    """A tracker whose on_epoch_end takes 5 s: longer than an epoch and than rank 0's wait (1 s)."""

    event_timeout_s = 30.0

    def __init__(self) -> None:
        import threading

        self.never, self.epochs = threading.Event(), []

    def on_epoch_end(self, metrics):
        self.epochs.append(metrics["epoch"])
        self.never.wait(5)  # a slow tracking server (never set)


def test_a_stop_request_beside_a_slow_tracker_stops_the_fit_at_its_epoch(spark, split_df):
    tracker = SlowTracker()
    est = linear_estimator(maxEpochs=4, seed=3, numWorkers=1, loggers=[tracker, StopAtEpoch(2)])
    est.fit(split_df)
    assert est.progress.epoch == 2 and [h["epoch"] for h in est.history] == [1, 2]
    assert tracker.epochs == [1, 2]  # the tracker still got every epoch


def test_an_estimator_holding_optuna_pruning_is_refused_at_save_and_a_loaded_one_reports_with_a_new_one(
        spark, split_df, tmp_path):
    optuna = pytest.importorskip("optuna")
    from pyspark.ml import Pipeline

    from spark_torch_est import TorchEstimator
    from spark_torch_est.tuning import OptunaPruning

    study = optuna.create_study()
    trial = study.ask()
    est = linear_estimator(maxEpochs=2, seed=3, numWorkers=1, validationIndicatorCol="is_val",
                           loggers=[OptunaPruning(trial)])
    for save, folder in ((est.save, "saved"), (Pipeline(stages=[est]).save, "pipeline")):
        with pytest.raises(InvalidInputError, match=r"OptunaPruning \(trial 0\) cannot be saved"):
            save(str(tmp_path / folder))
    assert not (tmp_path / "saved").exists()  # refused before anything was written
    est.setLoggers([])
    est.save(str(tmp_path / "saved"))
    loaded = TorchEstimator.load(str(tmp_path / "saved"))
    loaded.setLoggers([*loaded.loggers, OptunaPruning(trial)])
    loaded.fit(split_df, duration="1ep")
    assert study.trials[0].intermediate_values == {1: loaded.history[0]["val_loss"]}  # the live study


@pytest.fixture(scope="module")
def optuna_study(spark, split_df, tmp_path_factory):
    """Two trials at once on the one SparkSession (``n_jobs=2``, ``numWorkers=1`` each on the
    two slots of local[2]), each with a CSVLogger; then a straight fit of each trial's
    parameters. Returns (study, estimator by trial number, straight fit by trial number,
    the CSV folder, each fit's (start, end) time by trial number)."""
    optuna = pytest.importorskip("optuna")
    from spark_torch_est import CSVLogger
    from spark_torch_est.tuning import OptunaPruning

    logs = tmp_path_factory.mktemp("optuna_csv")
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0), pruner=optuna.pruners.MedianPruner())
    for lr in (0.002, 0.05):
        study.enqueue_trial({"lr": lr})
    estimators, spans = {}, {}

    def objective(trial):
        est = linear_estimator(maxEpochs=3, seed=3, numWorkers=1, validationIndicatorCol="is_val",
                               config={"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True)},
                               loggers=[OptunaPruning(trial), CSVLogger(str(logs))])
        estimators[trial.number] = est
        started = time.monotonic()
        est.fit(split_df)
        spans[trial.number] = (started, time.monotonic())
        return est.history[-1]["val_loss"]

    study.optimize(objective, n_trials=2, n_jobs=2)
    straight = {}
    for trial in study.trials:
        est = linear_estimator(maxEpochs=3, seed=3, numWorkers=1, validationIndicatorCol="is_val",
                               config={"lr": trial.params["lr"]})
        straight[trial.number] = (est, est.fit(split_df))
    return study, estimators, straight, logs, spans


def test_two_trials_at_once_do_not_mix_their_progress_checkpoints_metrics_or_logs(optuna_study):
    import csv

    study, estimators, straight, logs, spans = optuna_study
    (a_start, a_end), (b_start, b_end) = spans[0], spans[1]
    assert a_start < b_end and b_start < a_end  # the two fits ran at once
    assert {t.state.name for t in study.trials} == {"COMPLETE"}
    assert len({est.checkpoint.run_id for est in estimators.values()}) == 2
    for number, est in estimators.items():
        trial = study.trials[number]
        alone, _ = straight[number]
        assert est.progress == alone.progress and est.progress.epoch == 3
        assert est.history == alone.history  # the same numbers as the trial alone: nothing of the other trial
        assert trial.intermediate_values == {h["epoch"]: h["val_loss"] for h in est.history}
        with open(logs / est.checkpoint.run_id[:12] / "metrics.csv") as file:
            rows = list(csv.DictReader(file))
        assert [float(r["val_loss"]) for r in rows] == [h["val_loss"] for h in est.history]


def test_the_best_trials_refit_equals_a_straight_fit_of_its_parameters_bitwise(optuna_study):
    study, estimators, straight, _, _ = optuna_study
    best = study.best_trial
    _, refit = straight[best.number]
    trained = estimators[best.number].checkpoint.model_state
    assert study.best_value == estimators[best.number].history[-1]["val_loss"]
    assert all(torch.equal(trained[k], v) for k, v in refit.checkpoint.model_state.items())
