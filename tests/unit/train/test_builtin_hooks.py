"""The built-in hooks a user notices in the run: ``SchedulerPerIteration`` changes the
learning rate at every step as the torch scheduler says, ``Throughput`` reports the rows
of an epoch over its time (the real loop, one rank in this process)."""

from __future__ import annotations

import time

import pytest

from spark_torch_est import Hook, SchedulerPerIteration, Throughput
from spark_torch_est.core.progress import Target
from tests.helpers import adam, mlp, step_lr, train_locally


class LearningRates(Hook):
    """Records the learning rate each step trains with."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def before_train_iter(self, optimizer):
        self.rates.append(optimizer.param_groups[0]["lr"])

    def state_dict(self):
        return {"rates": list(self.rates)}

    def load_state_dict(self, state):
        self.rates = list(state["rates"])


def _torch_rates(steps: int) -> list[float]:
    """The learning rates ``step_lr`` gives, stepped once per optimizer step."""
    optimizer = adam(mlp({}), {})
    scheduler = step_lr(optimizer, {})
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_scheduler_per_iteration_steps_the_learning_rate_at_every_step_as_torch_says():
    per_step = train_locally(Target(epoch=2), hooks={"per_step": SchedulerPerIteration(), "lr": LearningRates()})
    steps = per_step.progress.global_step
    assert steps > 10 and per_step.hook_states["lr"]["rates"] == pytest.approx(_torch_rates(steps), rel=1e-12)

    per_epoch = train_locally(Target(epoch=2), hooks={"lr": LearningRates()})  # without it: once per epoch
    rates = per_epoch.hook_states["lr"]["rates"]
    assert rates == [0.01] * (steps // 2) + [pytest.approx(0.007)] * (steps // 2)


def test_throughput_reports_the_rows_of_each_epoch_over_its_time():
    started = time.perf_counter()
    checkpoint = train_locally(Target(epoch=2), rows=300, hooks=[Throughput()])
    elapsed = time.perf_counter() - started
    rows_per_epoch = checkpoint.progress.samples / 2
    assert 0 < rows_per_epoch <= 300
    for entry in checkpoint.history:
        assert 0 < entry["epoch_time_s"] < elapsed
        assert entry["samples_per_s"] * entry["epoch_time_s"] == pytest.approx(rows_per_epoch)


def test_throughput_leaves_out_an_epoch_that_began_in_an_earlier_fit():
    part = train_locally(Target(epoch=1, global_step=5), hooks={"throughput": Throughput()})
    rest = train_locally(Target(epoch=2), resume=part.to_bytes(), hooks={"throughput": Throughput()})
    first, second = rest.history
    assert "samples_per_s" not in first and "epoch_time_s" not in first
    assert second["samples_per_s"] > 0 and second["epoch_time_s"] > 0
