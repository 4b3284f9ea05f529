"""The loop of one rank, run without Spark through LocalBarrier (world size 1)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_torch_est import Checkpoint, Hook
from spark_torch_est.cluster.barrier import LocalBarrier
from spark_torch_est.cluster.failure import INPUT, USER, RankFailure
from spark_torch_est.cluster.worker import run_rank
from spark_torch_est.core.progress import Target
from spark_torch_est.core.protocol import FEATURES, IS_VALIDATION, LABEL
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.hooks import STAGE_ARGUMENTS, STAGES
from tests.helpers import (
    LOCAL_LAUNCH,
    CountSteps,
    adam,
    arrow_batches,
    flat_weights,
    leave_group,
    mlp,
    rank_processes,
    sgd,
    step_lr,
    task_spec,
    train_locally,
    with_column,
)

_run = train_locally


def _failure(spec, batches=None):
    with pytest.raises(RankFailure) as error:
        run_rank(spec, LOCAL_LAUNCH, iter(arrow_batches() if batches is None else batches), LocalBarrier())
    return error.value.failure


def _weights(checkpoint: Checkpoint) -> np.ndarray:
    return torch.cat([v.reshape(-1) for v in checkpoint.model_state.values()]).numpy()


def test_two_plus_two_epochs_equal_four_bitwise():
    whole = _run(Target(epoch=4))
    half = _run(Target(epoch=2))
    resumed = _run(Target(epoch=4), resume=half.to_bytes())
    np.testing.assert_array_equal(_weights(whole), _weights(resumed))
    assert resumed.progress == whole.progress
    assert [e["epoch"] for e in resumed.history] == [1, 2, 3, 4]


def test_batch_durations_that_end_mid_epoch_resume_exactly():
    whole = _run(Target(epoch=3))          # 13 steps per epoch
    part = _run(Target(epoch=3, global_step=20))
    assert (part.progress.epoch, part.progress.batch_in_epoch, part.progress.sample_in_epoch) == (1, 7, 7 * 16)
    resumed = _run(Target(epoch=3), resume=part.to_bytes())
    np.testing.assert_array_equal(_weights(whole), _weights(resumed))
    assert resumed.history[1]["train_loss"] == pytest.approx(whole.history[1]["train_loss"], rel=1e-9)


def test_a_sample_duration_stops_after_the_step_that_reaches_it():
    checkpoint = _run(Target(epoch=3, samples=100))
    assert (checkpoint.progress.global_step, checkpoint.progress.samples) == (7, 112)


class SeenRows(Hook):
    """Records the labels (unique per row here) every step trains on."""

    def __init__(self):
        self.labels = []

    def after_train_iter(self, labels):
        self.labels.extend(labels.reshape(-1).tolist())

    def state_dict(self):
        return {"labels": list(self.labels)}

    def load_state_dict(self, state):
        self.labels = list(state["labels"])


def test_a_new_batch_size_continues_the_epoch_where_it_stopped_with_every_row_once():
    seen = SeenRows()
    part = _run(Target(epoch=1, global_step=5), hooks={"seen": seen}, batch_size=16)  # 80 of 200 rows
    rest = _run(Target(epoch=1), resume=part.to_bytes(), hooks={"seen": SeenRows()}, batch_size=64)
    labels = rest.hook_states["seen"]["labels"]
    expected = sorted(float(v) for v in arrow_batches()[0].column(1).to_pylist())
    assert sorted(labels) == pytest.approx(expected)  # every row exactly once in the epoch
    assert rest.progress.global_step == 5 + 2 and rest.progress.samples == 200  # 120 rows left: 64 + 56
    assert rest.progress.epoch == 1 and len(rest.history) == 1


class EveryArgument(Hook):
    """Records, for every stage, the values of the arguments the loop offers."""

    def __init__(self):
        self.calls = []

    def state_dict(self):
        return {"calls": self.calls}


def _record(stage):
    def method(self, **kwargs):
        state = kwargs["state"]
        self.calls.append({
            "stage": stage, "epoch": kwargs["epoch"], "batch_idx": kwargs["batch_idx"],
            "global_step": kwargs["global_step"], "state": [state.epoch, state.batch_in_epoch, state.global_step],
            "has_batch": "batch" in kwargs, "has_loss": kwargs.get("loss") is not None,
        })
    return method


for _stage in STAGES:
    if _stage != "on_exception":
        setattr(EveryArgument, _stage, _record(_stage))


def test_a_fit_resumed_mid_epoch_goes_on_counting_its_batches():
    creators = Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss(), hooks={"every": EveryArgument()})
    part = _run(Target(epoch=1, global_step=5), creators=creators)
    resumed = _run(Target(epoch=1), resume=part.to_bytes(), creators=creators)
    calls = resumed.hook_states["every"]["calls"]
    steps = [c for c in calls if c["stage"] == "after_train_iter"]
    assert steps[0]["batch_idx"] == 5 and steps[0]["global_step"] == 6
    assert [c["batch_idx"] for c in calls if c["stage"] == "before_run"] == [4]  # the last batch trained
    first_step = next(i for i, c in enumerate(calls) if c["stage"] == "after_train_iter")
    assert "before_train_epoch" not in [c["stage"] for c in calls[:first_step]]  # the epoch had begun


def test_every_stage_gets_the_arguments_of_what_the_loop_did():
    creators = Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss(), hooks={"every": EveryArgument()})
    rows, batch = 40, 16  # 3 steps per epoch, the last of 8 rows
    spec = task_spec(Target(epoch=2), creators=creators, batch_size=batch)
    validation = with_column(arrow_batches(rows)[0], IS_VALIDATION, pa.array([i % 4 == 0 for i in range(rows)]))
    calls = Checkpoint.from_bytes(run_rank(spec, LOCAL_LAUNCH, iter([validation]), LocalBarrier())) \
        .hook_states["every"]["calls"]
    for call in calls:  # `state` always tells the same progress as the other arguments
        assert call["state"][0] == call["epoch"] and call["state"][2] == call["global_step"], call
    steps_per_epoch = 2  # 30 training rows, 16 per batch
    by_stage = {}
    for call in calls:
        by_stage.setdefault(call["stage"], []).append(call)
    assert [c["global_step"] for c in by_stage["before_optimizer_step"]] == [0, 1, 2, 3]
    assert [c["global_step"] for c in by_stage["after_optimizer_step"]] == [1, 2, 3, 4]
    assert [c["global_step"] for c in by_stage["after_train_iter"]] == [1, 2, 3, 4]
    assert [c["batch_idx"] for c in by_stage["after_train_iter"]] == [0, 1, 0, 1]
    assert [c["batch_idx"] for c in by_stage["before_train_epoch"]] == [0, 0]
    assert [c["batch_idx"] for c in by_stage["after_train_epoch"]] == [steps_per_epoch - 1] * 2  # never a val batch
    assert [c["epoch"] for c in by_stage["after_train_epoch"]] == [1, 2]  # completed epochs
    assert [c["batch_idx"] for c in by_stage["after_val_iter"]] == [0, 0]  # 10 validation rows: one batch
    assert all(c["has_batch"] and c["has_loss"] for c in by_stage["after_train_iter"] + by_stage["after_val_iter"])
    assert not any(c["has_batch"] for c in by_stage["before_run"] + by_stage["after_run"])
    assert by_stage["after_run"][0]["global_step"] == 4
    for stage in STAGES:
        if stage != "on_exception":
            assert stage in by_stage, stage
            names = set(STAGE_ARGUMENTS[stage])
            assert {"epoch", "batch_idx", "global_step", "state"} <= names


def test_hook_exception_names_hook_stage_and_rank():
    class Boom(Hook):
        def after_train_iter(self, global_step):
            if global_step == 3:
                raise ValueError("boom at 3")

    failure = _failure(task_spec(hooks={"boom": Boom()}))
    assert (failure.kind, failure.hook, failure.stage, failure.rank) == (USER, "boom", "after_train_iter", 0)
    assert "boom at 3" in failure.message and "ValueError" in failure.traceback


def test_an_empty_partition_is_an_input_error():
    failure = _failure(task_spec(), batches=[])
    assert failure.kind == INPUT and "no training rows" in failure.message


@pytest.mark.parametrize("loss, words", [
    (lambda out, y: (out - y) ** 2, "returned a Tensor of shape [16, 1]"),
    (lambda out, y: 0.5, "float"),
    (lambda out, y: (((out - y) ** 2).mean(), out), "a tuple of 2 (a Tensor of shape [], a Tensor of shape [16, 1])"),
])
def test_a_loss_that_is_not_one_value_is_a_user_error_with_the_fix(loss, words):
    creators = Creators(model=mlp, optimizer=adam, loss=loss)
    failure = _failure(task_spec(creators=creators))
    assert failure.kind == USER and words in failure.message and ".mean()" in failure.message
    assert "the loss (function " in failure.message and "a bug in spark_torch_est" not in failure.message


class ReturnsJunk(Hook):
    """Returns ``value`` from ``stage``."""

    def __init__(self, stage: str, value) -> None:
        self.stage, self.value = stage, value

    def before_train_iter(self):
        return self.value if self.stage == "before_train_iter" else None

    def before_backward(self):
        return self.value if self.stage == "before_backward" else None


class TrainStepJunk(Hook):
    def train_step(self, model, batch, loss_fn):
        return loss_fn(model(batch[0]), batch[1]).item()  # a float: backward and the epoch's mean need the tensor


@pytest.mark.parametrize("hook, stage, words", [
    (ReturnsJunk("before_train_iter", True), "before_train_iter", "returned bool True; expected None or a "
                                                                   "replacement batch (inputs, labels)"),
    (ReturnsJunk("before_train_iter", (torch.zeros(2, 8),)), "before_train_iter", "returned a tuple of 1 (a Tensor "
                                                                                   "of shape [2, 8])"),
    (ReturnsJunk("before_backward", 1.0), "before_backward", "returned float 1.0; expected None or a replacement "
                                                             "loss: a tensor holding one value"),
    (ReturnsJunk("before_backward", torch.zeros(16, 1)), "before_backward", "returned a Tensor of shape [16, 1]"),
    (TrainStepJunk(), "train_step", "returned float"),
])
def test_a_hook_that_returns_what_its_stage_cannot_take_is_named_with_what_was_expected(hook, stage, words):
    failure = _failure(task_spec(hooks={"junk": hook}))
    assert (failure.kind, failure.stage, failure.hook) == (USER, stage, "junk")
    assert f"hook 'junk' ({type(hook).__name__}).{stage}() {words}" in failure.message
    assert "a bug in spark_torch_est" not in failure.message


class TwoOutputs(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.linear = kind, torch.nn.Linear(8, 1)

    def forward(self, x):
        y = self.linear(x)
        return (y, x) if self.kind == "tuple" else {"prediction": y, "features": x}


@pytest.mark.parametrize("kind, words", [
    ("tuple", "returned a tuple of 2 (a Tensor of shape [2, 1], a Tensor of shape [2, 8])"),
    ("dict", "returned a dict with keys 'prediction', 'features'"),
])
def test_a_model_that_returns_a_tuple_or_a_dict_is_named_with_what_the_loss_wants(kind, words):
    creators = Creators(model=lambda config: TwoOutputs(kind), optimizer=adam, loss=torch.nn.MSELoss())
    failure = _failure(task_spec(creators=creators))
    assert failure.kind == USER
    assert f"the model's forward (TwoOutputs) {words}; expected one torch.Tensor of outputs" in failure.message
    assert "'tuple' object has no attribute" not in failure.message
    assert "a bug in spark_torch_est" not in failure.message


@pytest.mark.parametrize("value, words", [
    ({"mae": 0.5, "rmse": 0.7}, "returned a dict with keys 'mae', 'rmse'; expected a number or a tensor holding "
                                "one value"),
    (torch.zeros(3), "returned a Tensor of shape [3]"),
    ("0.5", "returned str '0.5'"),
])
def test_a_metric_that_returns_more_than_one_number_is_named(value, words):
    creators = Creators(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(), metrics={"scores": lambda o, y: value})
    rows = 40
    batches = [with_column(arrow_batches(rows)[0], IS_VALIDATION, pa.array([i % 4 == 0 for i in range(rows)]))]
    failure = _failure(task_spec(creators=creators), batches)
    assert failure.kind == USER and failure.stage == "validation"
    assert f"metric 'scores' {words}" in failure.message
    assert "a bug in spark_torch_est" not in failure.message


class AddsToTheEntry(Hook):
    def __init__(self, value) -> None:
        self.value = value

    def after_train_epoch(self, metrics):
        metrics["score"] = self.value


def test_numpy_numbers_a_hook_adds_to_the_history_are_kept_as_numbers_and_a_stranger_value_names_the_hook():
    checkpoint = train_locally(hooks={"adds": AddsToTheEntry(np.float64(0.25))})  # e.g. an sklearn score
    assert checkpoint.history[0]["score"] == 0.25 and type(checkpoint.history[0]["score"]) is float
    failure = _failure(task_spec(hooks={"adds": AddsToTheEntry(object())}))
    assert (failure.kind, failure.stage, failure.hook) == (USER, "after_train_epoch", "adds")
    assert "hook 'adds' (AddsToTheEntry).after_train_epoch() put an object in metrics['score']; expected" in \
        failure.message


def test_a_non_finite_loss_fails_at_its_step_unless_allowed():
    batch = arrow_batches(64)[0]
    labels = batch.column(1).to_numpy().copy()
    labels[40] = math.nan
    batches = [with_column(batch, LABEL, pa.array(labels), at=1)]
    creators = Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss())
    spec = task_spec(Target(epoch=1), creators=creators, batch_size=16, seed=0)
    failure = _failure(spec, batches)
    assert failure.kind == USER and "non-finite loss (nan)" in failure.message
    assert "epoch 1" in failure.message and "labelCol 'label'" in failure.message
    assert "allowNonFinite=True" in failure.message
    allowed = run_rank(task_spec(Target(epoch=1), creators=creators, batch_size=16, allow_non_finite=True),
                       LOCAL_LAUNCH, iter(batches), LocalBarrier())
    assert math.isnan(Checkpoint.from_bytes(allowed).history[0]["train_loss"])


class SqrtAtZero(torch.nn.Module):
    """A finite output whose gradient is not: d sqrt(|w|) / dw at w = 0."""

    def __init__(self):
        super().__init__()
        self.linear, self.w = torch.nn.Linear(8, 1), torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.linear(x) + torch.sqrt(self.w.abs())


def test_weights_made_non_finite_by_a_finite_loss_never_reach_a_checkpoint():
    creators = Creators(model=lambda c: SqrtAtZero(), optimizer=sgd, loss=torch.nn.MSELoss())
    failure = _failure(task_spec(Target(epoch=1, global_step=1), creators=creators))
    assert failure.kind == USER and "weights became NaN or infinite (w)" in failure.message
    assert "allowNonFinite=True" in failure.message


def test_a_hook_can_skip_a_batch_whose_loss_is_not_finite():
    class SkipNonFinite(Hook):
        def before_backward(self, loss):
            if not torch.isfinite(loss):
                return loss.new_zeros(())

    batch = arrow_batches(64)[0]
    features = np.stack(batch.column(0).to_numpy(zero_copy_only=False)).astype(np.float32)
    features[40, 3] = math.nan  # the model's outputs for that row are NaN too
    batch = with_column(batch, FEATURES, pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), 8), at=0)
    creators = Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss(), hooks={"skip": SkipNonFinite()})
    spec = task_spec(Target(epoch=2), creators=creators, batch_size=16)
    checkpoint = Checkpoint.from_bytes(run_rank(spec, LOCAL_LAUNCH, iter([batch]), LocalBarrier()))
    assert all(bool(torch.isfinite(v).all()) for v in checkpoint.model_state.values())
    assert checkpoint.progress.global_step == 8


def test_batch_norm_on_a_one_row_batch_says_how_to_fix_it():
    creators = Creators(model=lambda c: torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4),
                                                            torch.nn.Linear(4, 1)),
                        optimizer=sgd, loss=torch.nn.MSELoss())
    failure = _failure(task_spec(creators=creators, batch_size=16), arrow_batches(33))  # 16 + 16 + 1
    assert failure.kind == USER and "single row" in failure.message and "batchSize" in failure.message


def test_flat_weights_helper_sees_every_parameter():
    assert flat_weights(mlp({})).size == 8 * 16 + 16 + 16 + 1


def test_a_creator_from_a_module_executors_cannot_import_gets_a_hint(tmp_path, monkeypatch):
    import importlib
    import sys

    (tmp_path / "driver_only_module.py").write_text(
        "import torch\ndef make(config):\n    return torch.nn.Linear(8, 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("driver_only_module")
    creators = Creators(model=module.make, optimizer=adam, loss=torch.nn.MSELoss())
    spec = task_spec(creators=creators)
    del sys.modules["driver_only_module"]
    sys.path.remove(str(tmp_path))  # now this process is an executor without the module
    failure = _failure(spec)
    assert failure.kind == USER and failure.stage == "setup"
    assert "'driver_only_module'" in failure.message and "register_pickle_by_value" in failure.message


def test_a_model_that_does_not_fit_the_features_is_a_user_error_at_setup():
    creators = Creators(model=lambda c: torch.nn.Linear(10, 1), optimizer=adam, loss=torch.nn.MSELoss())
    failure = _failure(task_spec(creators=creators))
    assert (failure.kind, failure.stage) == (USER, "setup") and "mat1 and mat2" in failure.message


def test_a_changed_config_sets_the_optimizers_hyperparameters_and_keeps_its_state():
    def run(config, resume=None):
        creators = Creators(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(), config=config)
        spec = task_spec(Target(epoch=2 if resume else 1), creators=creators, resume=resume)
        return Checkpoint.from_bytes(run_rank(spec, LOCAL_LAUNCH, iter(arrow_batches()), LocalBarrier()))

    first = run({"lr": 0.01})
    frozen = run({"lr": 0.0}, resume=first.to_bytes())  # honored: nothing moves at lr 0
    np.testing.assert_array_equal(_weights(first), _weights(frozen))
    assert frozen.optimizer_state["param_groups"][0]["lr"] == 0.0
    steps = frozen.optimizer_state["state"][0]["step"]
    assert int(steps) == 2 * first.progress.global_step, "Adam's state carried over"
    same = run({"lr": 0.01}, resume=first.to_bytes())
    assert not np.array_equal(_weights(first), _weights(same))




def test_a_new_config_changes_only_what_it_changes_and_a_schedule_goes_on():
    def run(config, epochs, resume=None):
        creators = Creators(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(), scheduler=step_lr, config=config)
        spec = task_spec(Target(epoch=epochs), creators=creators, resume=resume)
        return Checkpoint.from_bytes(run_rank(spec, LOCAL_LAUNCH, iter(arrow_batches()), LocalBarrier()))

    def lr(checkpoint):
        return checkpoint.optimizer_state["param_groups"][0]["lr"]

    first = run({"lr": 0.01}, 3)
    assert lr(first) == pytest.approx(0.01 * 0.7 ** 3)
    unrelated = run({"lr": 0.01, "width": 16}, 5, first.to_bytes())  # another key: the schedule goes on
    assert lr(unrelated) == pytest.approx(0.01 * 0.7 ** 5)
    changed = run({"lr": 0.05}, 5, first.to_bytes())                  # a new lr: taken, then scheduled
    assert lr(changed) == pytest.approx(0.05 * 0.7 ** 2)


def test_a_hook_added_under_an_old_name_starts_from_its_own_state():
    first = _run(Target(epoch=1), hooks={"count": CountSteps()})
    assert first.hook_states["count"] == {"steps": 13, "runs": 1}
    kept = _run(Target(epoch=2), resume=first.to_bytes(), hooks={"count": CountSteps()})
    fresh = _run(Target(epoch=2), resume=first.to_bytes(), hooks={"count": CountSteps(start=100)},
                 fresh_hooks=("count",))
    assert kept.hook_states["count"] == {"steps": 26, "runs": 2}
    assert fresh.hook_states["count"] == {"steps": 113, "runs": 1}


def _compiled(target: Target, resume: bytes | None = None, **fields) -> Checkpoint:
    creators = Creators(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(), config={"dropout": 0.3})
    return _run(target, resume=resume, creators=creators, compile_model=True, rows=96, **fields)  # 6 steps of 16


@pytest.mark.slow  # compiling takes ~20 s with inductor's cache warm, a minute or more cold, on 2 shared cores
def test_a_compiled_model_trains_keeps_plain_keys_and_resumes_exactly(caplog):
    import logging

    from torch._dynamo.utils import counters

    with caplog.at_level(logging.INFO, logger="spark_torch_est.train.loop"):
        whole = _compiled(Target(epoch=2))
    assert counters["stats"]["unique_graphs"] >= 1, "dynamo compiled the model"
    compiled_logs = [r.getMessage() for r in caplog.records if "compileModel" in r.getMessage()]
    assert len(compiled_logs) == 1, "the compile time is reported once per fit"
    assert set(whole.model_state) == set(mlp({}).state_dict()), "no _orig_mod. keys"
    assert whole.history[-1]["train_loss"] < whole.history[0]["train_loss"]
    half = _compiled(Target(epoch=1))
    resumed = _compiled(Target(epoch=2), resume=half.to_bytes())
    np.testing.assert_array_equal(_weights(whole), _weights(resumed))


class FailsAtTheEnd(Hook):
    """Its state cannot be saved once the run is over: the final checkpoint fails."""

    heard: list = []

    def __init__(self) -> None:
        self.over = False

    def after_run(self) -> None:
        self.over = True

    def state_dict(self) -> dict:
        if self.over:
            raise OSError("No space left on device")
        return {}

    def on_exception(self, exception, stage) -> None:
        FailsAtTheEnd.heard.append((type(exception).__name__, stage))


def test_a_final_checkpoint_that_fails_calls_on_exception():
    FailsAtTheEnd.heard = []
    creators = Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss(), hooks={"end": FailsAtTheEnd()})
    with pytest.raises(RankFailure, match="No space left on device"):
        _run(Target(epoch=1), creators=creators)
    assert FailsAtTheEnd.heard == [("OSError", "checkpoint")]


def _host_reads(monkeypatch) -> list[str]:
    """Counts the package's reads of a tensor's value on the host (each waits for the
    device to finish what it was given): ``item``, ``tolist``, ``float``/``int``/``bool``."""
    import sys

    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("spark_torch_est."):
                reads.append(f"{caller}.{_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_a_fit_reads_no_tensor_on_the_host_each_step(monkeypatch):
    short = _host_reads(monkeypatch)
    _run(Target(epoch=1), rows=16 * 20, creators=Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss()))
    setup_and_end = len(short) - 20 // 10  # what a fit reads beside its steps' losses
    short.clear()
    checkpoint = _run(Target(epoch=1), rows=16 * 250,
                      creators=Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss()))
    assert checkpoint.progress.global_step == 250
    assert len(short) <= 250 // 10 + setup_and_end, sorted(set(short))
    assert setup_and_end < 40  # setup (the ranks agreeing on rows), the epoch's end and the checkpoint


class NaNAt(Hook):
    """Makes the loss of the step after ``global_step`` completed steps NaN."""

    def __init__(self, global_step):
        self.global_step = global_step

    def before_backward(self, loss, global_step):
        return loss * math.nan if global_step == self.global_step else None


def test_a_non_finite_loss_read_later_names_its_step_and_no_checkpoint_after_it_exists(tmp_path):
    from spark_torch_est.checkpoints.storage import CheckpointDir
    from spark_torch_est.core.progress import Interval

    creators = Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss(), hooks={"nan": NaNAt(12)})
    spec = task_spec(Target(epoch=3), creators=creators, checkpoint_dir=str(tmp_path),
                     checkpoint_every=Interval(5, "ba"))
    failure = _failure(spec)  # 13 steps per epoch: step 13 is the epoch's last, read at its end
    assert failure.kind == USER and failure.stage == "loss"
    assert "non-finite loss (nan) at epoch 1, batch 12 (global step 13) on rank 0" in failure.message
    assert "the model diverged" in failure.message
    written = sorted(c.global_step for c in CheckpointDir(str(tmp_path), run_id="0123456789abcdef").files())
    assert written == [5, 10]

    creators = Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss(), hooks={"nan": NaNAt(16)})
    spec = task_spec(Target(epoch=3), creators=creators, checkpoint_dir=str(tmp_path / "b"),
                     checkpoint_every=Interval(5, "ba"))
    failure = _failure(spec)  # step 17 is read before the checkpoint of step 20 would be written
    assert "at epoch 2, batch 3 (global step 17)" in failure.message
    written = sorted(c.global_step for c in CheckpointDir(str(tmp_path / "b"), run_id="0123456789abcdef").files())
    assert written == [5, 10, 15]


class AllKeywords(Hook):
    """Takes every argument of a per-step stage through ``**kwargs``; rank 1 asks to stop
    after global step 3 without naming ``control``."""

    def after_train_iter(self, **kwargs):
        if kwargs["rank"] == 1 and kwargs["global_step"] == 3:
            kwargs["control"].stop_training = True


class StopsOnRankOne(Hook):
    """Names ``control`` in a per-step stage: the ranks vote after every step; rank 1 asks
    to stop after global step 12."""

    def after_train_iter(self, control, rank, global_step):
        if rank == 1 and global_step == 12:
            control.stop_training = True


def _two_rank_fits(rank: int, store_path: str, results) -> None:
    """Runs two fits of the real loop on rank ``rank`` of a two-rank gloo group, counting the
    collectives each makes; puts ``(rank, hook, collectives, global steps)`` in ``results``."""
    from datetime import timedelta

    import torch.distributed as dist

    from spark_torch_est.ingest.tables import read_rows
    from spark_torch_est.train.loop import Trainer

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    calls = []
    for name in ("all_reduce", "all_gather", "broadcast", "barrier"):
        def counted(*args, _original=getattr(dist, name), _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        for hook in (AllKeywords(), StopsOnRankOne()):
            creators = Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss(), hooks={"hook": hook})
            spec = task_spec(Target(epoch=1), creators=creators, world_size=2)
            ingested = read_rows(iter(arrow_batches(16 * 20, seed=rank)), spec.schema, spec.columns)
            trainer = Trainer(creators, spec, ingested, rank, 2, torch.device("cpu"))
            calls.clear()
            trainer.run()
            results.put((rank, type(hook).__name__, len(calls), trainer.state.progress.global_step))
    finally:
        leave_group()


def test_only_a_hook_that_names_control_in_a_step_stage_costs_a_collective_per_step(tmp_path):
    context = rank_processes()
    results = context.Queue()
    processes = [context.Process(target=_two_rank_fits, args=(r, str(tmp_path / "store"), results)) for r in range(2)]
    for process in processes:
        process.start()
    reported = (results.get(timeout=120) for _ in range(4))
    outcome = {(rank, hook): (calls, steps) for rank, hook, calls, steps in reported}
    for process in processes:
        process.join(30)
    steps_per_epoch = 20
    for rank in (0, 1):
        calls, steps = outcome[rank, "AllKeywords"]
        assert steps == steps_per_epoch  # the request waited for the epoch's end: both ranks trained it all
        assert calls < steps_per_epoch // 2, "no collective per step for a hook that takes **kwargs (a few to set up)"
        calls, steps = outcome[rank, "StopsOnRankOne"]
        assert steps == 12  # both ranks stopped after the step rank 1 asked at
        assert calls >= 12, "one vote after each step"
