"""The hook contract on local[2]: 2 ranks, real DDP."""

from __future__ import annotations

import json
import os
import threading
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from spark_torch_est import Checkpoint, EarlyStopping, Hook
from spark_torch_est.errors import InvalidInputError, TrainingFailedError
from tests.helpers import flat_weights, linear_estimator, spark_jobs_started

pytestmark = pytest.mark.spark


class Observer(Hook):
    """Records, per rank, what the stages received; counts steps across fits."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.steps = 0

    def before_backward(self, loss, outputs, batch, rank, world_size, global_step):
        if global_step == 0:
            inputs, labels = batch
            seen = {"loss": list(loss.shape), "outputs": list(outputs.shape), "inputs": list(inputs.shape),
                    "labels": list(labels.shape), "rank": rank, "world_size": world_size,
                    "requires_grad": loss.requires_grad}
            with open(os.path.join(self.directory, f"seen{rank}.json"), "w") as f:
                json.dump(seen, f)

    def after_train_iter(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_hooks_see_the_step_and_keep_state_across_fits(spark, linear_df, tmp_path):
    observer = Observer(str(tmp_path))
    est = linear_estimator(hooks=[observer])
    est.fit(linear_df, duration="1ep")
    first = est.progress.global_step
    assert observer.steps == first  # loaded back into the driver's object
    est.fit(linear_df, duration="1ep")
    assert observer.steps == est.progress.global_step == 2 * first

    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen{rank}.json").read_text())
        assert seen == {"loss": [], "outputs": [64, 1], "inputs": [64, 8], "labels": [64, 1],
                        "rank": rank, "world_size": 2, "requires_grad": True}


class StopFromRank1(Hook):
    def __init__(self, directory, at_step):
        self.directory, self.at_step = directory, at_step

    def after_train_iter(self, rank, global_step, control):
        if rank == 1 and global_step == self.at_step:
            control.stop_training = True

    def after_run(self, rank, global_step):
        with open(os.path.join(self.directory, f"stopped{rank}"), "w") as f:
            f.write(str(global_step))


def test_a_stop_request_from_one_rank_stops_every_rank_at_the_same_step(spark, linear_df, tmp_path):
    est = linear_estimator(hooks=[StopFromRank1(str(tmp_path), at_step=7)])
    est.fit(linear_df)
    assert est.progress.global_step == 7
    assert (tmp_path / "stopped0").read_text() == (tmp_path / "stopped1").read_text() == "7"
    # stopping is not the end of the run: the next fit goes on from step 7
    assert (est.progress.epoch, est.progress.batch_in_epoch) == (0, 7)


class StopAtEpochStartFromRank1(Hook):
    def before_train_epoch(self, rank, epoch, control):
        if rank == 1 and epoch == 1:
            control.stop_training = True


def test_a_stop_request_at_an_epoch_start_from_one_rank_stops_every_rank(spark, linear_df):
    est = linear_estimator(hooks=[StopAtEpochStartFromRank1()])
    started = time.monotonic()
    est.fit(linear_df)  # rank 0 alone would train epoch 2 and wait for rank 1 in its all-reduce
    assert time.monotonic() - started < 60
    assert (est.progress.epoch, est.progress.batch_in_epoch) == (1, 0)
    assert len(est.history) == 1


class ZeroLoss(Hook):
    def __init__(self, directory):
        self.directory = directory

    def before_run(self, model, rank):
        np.save(os.path.join(self.directory, f"before{rank}.npy"), flat_weights(model))

    def before_backward(self, loss):
        return loss * 0.0

    def after_run(self, model, rank):
        np.save(os.path.join(self.directory, f"after{rank}.npy"), flat_weights(model))


def test_a_zero_loss_from_before_backward_leaves_weights_unchanged(spark, linear_df, tmp_path):
    linear_estimator(hooks=[ZeroLoss(str(tmp_path))], maxEpochs=1).fit(linear_df)
    for rank in (0, 1):
        np.testing.assert_array_equal(np.load(tmp_path / f"before{rank}.npy"), np.load(tmp_path / f"after{rank}.npy"))


class Accumulate(Hook):
    """Gradient accumulation over two half-batches, plus clipping: a custom strategy."""

    def __init__(self):
        self.calls = 0

    def train_step(self, model, batch, loss_fn, optimizer):
        inputs, labels = batch
        optimizer.zero_grad()
        total = 0.0
        for part_x, part_y in zip(inputs.chunk(2), labels.chunk(2)):
            loss = loss_fn(model(part_x), part_y) / 2
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        self.calls += 1
        return total

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_a_train_step_override_is_used_and_learns(spark, linear_df, linear_data):
    _, _, w, _ = linear_data
    hook = Accumulate()
    est = linear_estimator(hooks=[hook], maxEpochs=6)
    model = est.fit(linear_df)
    assert hook.calls == est.progress.global_step > 0
    np.testing.assert_allclose(model.torch_model().weight.detach().numpy().ravel(), w, atol=0.05)


class FailOnRank(Hook):
    def __init__(self):
        self.rank_to_fail = None

    def after_train_iter(self, rank, global_step):
        if rank == self.rank_to_fail and global_step % 10 == 3:
            raise RuntimeError(f"deliberate failure at step {global_step}")


def test_a_failing_hook_names_hook_stage_and_rank_and_loses_nothing(spark, linear_df):
    failing = FailOnRank()
    est = linear_estimator(hooks={"flaky": failing})
    est.fit(linear_df, duration="1ep")
    checkpoint, progress = est.checkpoint, est.progress

    failing.rank_to_fail = 1
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as error:
        est.fit(linear_df)
    assert time.monotonic() - started < 60
    assert (error.value.rank, error.value.stage, error.value.hook) == (1, "after_train_iter", "flaky")
    assert "deliberate failure" in str(error.value) and "Traceback" in error.value.remote_traceback
    assert not error.value.retryable
    assert est.checkpoint is checkpoint and est.progress == progress

    failing.rank_to_fail = None
    est.fit(linear_df, duration="1ep")
    assert est.progress.epoch == progress.epoch + 1


def test_early_stopping_stops_and_stays_stopped(spark, linear_df):
    stopper = EarlyStopping(monitor="train_loss", patience=1, min_delta=10.0)
    est = linear_estimator(hooks=[stopper], maxEpochs=10)
    est.fit(linear_df)
    assert est.progress.epoch == 2 and stopper.stopped_epoch == 2
    est.fit(linear_df)  # the stopped run does not train on ...
    assert est.progress.epoch == 2
    est.reset()  # ... until a new run starts
    assert stopper.stopped_epoch is None and stopper.bad_epochs == 0


class BestLoss(Hook):
    """Keeps the lowest epoch loss as a numpy number and every epoch's loss in a numpy array."""

    def __init__(self) -> None:
        self.best, self.losses = np.float64(np.inf), np.zeros(0)

    def after_train_epoch(self, metrics):
        self.best = np.minimum(self.best, metrics["train_loss"])
        self.losses = np.append(self.losses, metrics["train_loss"])

    def state_dict(self):
        return {"best": self.best, "losses": self.losses}

    def load_state_dict(self, state):
        self.best, self.losses = state["best"], np.asarray(state["losses"])


def test_a_hook_state_of_numpy_values_is_checkpointed_as_numbers_and_tensors(spark, linear_df):
    hook = BestLoss()
    est = linear_estimator(hooks=[hook], maxEpochs=2)
    est.fit(linear_df, duration="1ep")
    est.fit(linear_df, duration="1ep")  # resumes the hook's state

    losses = [entry["train_loss"] for entry in est.history]
    assert type(hook.best) is float and hook.best == min(losses)
    saved = Checkpoint.from_bytes(est.checkpoint.to_bytes()).hook_states["BestLoss"]
    assert torch.equal(saved["losses"], torch.tensor(losses, dtype=torch.float64))


class KeepsInState(Hook):
    """Returns ``value`` from its state_dict under "kept"."""

    def __init__(self, value=None) -> None:
        self.value = value

    def state_dict(self):
        return {"kept": self.value}

    def load_state_dict(self, state):
        self.value = state["kept"]


@pytest.mark.parametrize("make", [threading.Lock, lambda: Fraction(1, 3)], ids=["lock", "custom object"])
def test_a_hook_state_a_checkpoint_cannot_store_is_refused_naming_hook_and_key(spark, linear_df, make):
    refusal = r"hook 'KeepsInState': state_dict\(\)\['kept'\] holds a .*torch.load\(weights_only=True\)"
    with pytest.raises(InvalidInputError, match=refusal):
        linear_estimator(hooks=[KeepsInState(make())])

    hook = KeepsInState()  # storable when the estimator is built, not when it fits
    est, jobs = linear_estimator(hooks=[hook]), spark_jobs_started(spark)
    hook.value = make()
    with pytest.raises(InvalidInputError, match=refusal):
        est.fit(linear_df)
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None


class OneBackward(Hook):
    """A train_step as the docs' hooks write it: one forward, one backward, one step."""

    def __init__(self):
        self.losses = []

    def train_step(self, model, batch, loss_fn, optimizer):
        inputs, labels = batch
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()
        self.losses.append(float(loss))
        return loss


def test_a_train_step_on_a_rank_without_rows_in_the_short_last_step_counts_nowhere(spark, linear_data):
    """129 rows at 64 a step on 2 ranks: the last step has one row, so one rank's train_step
    gets an empty batch and returns NaN (a mean over no rows); that loss counts nowhere, not
    as a diverged model."""
    x, y, w, _ = linear_data
    df = spark.createDataFrame([(row.tolist(), float(t)) for row, t in zip(x[:129], y[:129])], ["features", "label"])
    est = linear_estimator(hooks=[OneBackward()], batchSize=64, maxEpochs=3)
    est.fit(df)
    assert est.progress.global_step == 3 * 2
    assert all(np.isfinite(e["train_loss"]) for e in est.history)
    assert est.history[-1]["train_loss"] < est.history[0]["train_loss"]
