"""Which maps of a tuner's split are trained together (no Spark: the estimator's Params and
the planned specs decide), and how their progress is shown."""

from __future__ import annotations

import dataclasses

import pytest

from spark_torch_est.cluster.messages import RankMessage
from spark_torch_est.core.progress import Progress, Target
from spark_torch_est.loggers.base import Logger
from spark_torch_est.loggers.view import DriverView
from spark_torch_est.together import RunViews, job_refusal, together_refusal
from tests.helpers import estimator, task_spec


@pytest.mark.parametrize("change, maps, reason", [
    ({}, lambda e: [{e.config: {"lr": 0.1}}], "a split of one map"),
    ({}, lambda e: [{e.config: {"lr": 0.1}}, {e.featuresCol: "other"}], "a map sets featuresCol"),
    ({}, lambda e: [{e.numWorkers: 1}, {e.numWorkers: 2}], "a map sets numWorkers"),
    ({"loggers": [Logger()]}, lambda e: [{e.seed: 1}, {e.seed: 2}], "loggers"),
    ({"minWorkers": 1}, lambda e: [{e.seed: 1}, {e.seed: 2}], "minWorkers"),
    ({"strategy": "fsdp"}, lambda e: [{e.seed: 1}, {e.seed: 2}], "strategy='fsdp'"),
])
def test_maps_that_may_change_the_rows_or_the_job_are_fitted_one_at_a_time(change, maps, reason):
    est = estimator(**change)
    assert reason in together_refusal(est, maps(est))


def test_maps_that_change_what_a_rank_trains_are_trained_together():
    est = estimator()
    maps = [{est.config: {"lr": 0.1}, est.batchSize: 32, est.maxEpochs: 2, est.seed: 1, est.precision: "bf16-mixed"},
            {est.config: {"lr": 0.01}, est.checkpointInterval: "1ep", est.allowNonFinite: True}]
    assert together_refusal(est, maps) is None


def test_planned_specs_share_a_job_only_when_the_job_is_the_same():
    spec = task_spec()
    assert job_refusal([spec, dataclasses.replace(spec, batch_size=7, seed=3, run_id="other")]) is None
    assert job_refusal([spec, dataclasses.replace(spec, world_size=3)]) == "their jobs differ in world_size"
    assert job_refusal([dataclasses.replace(spec, lightning={"max_epochs": 1})] * 2) == \
        "the model is a LightningModule"


def test_each_runs_view_takes_over_when_rank_0_says_the_run_before_ended():
    views = [DriverView(False, Progress(), Target(epoch=2), 64, f"map {i}") for i in range(3)]
    shown = RunViews(views)
    shown.handle(RankMessage.for_run_done(0, Progress(epoch=2, global_step=20), ""))
    assert views[0]._closed.is_set() and not views[1]._closed.is_set()
    assert views[1]._phase == "training map 2 of 3"
    shown.handle(RankMessage.for_run_done(1, Progress(epoch=2, global_step=20), ""))
    shown.handle(RankMessage.for_run_done(2, Progress(epoch=2, global_step=20), ""))
    assert all(view._closed.is_set() for view in views)
    shown.close()
