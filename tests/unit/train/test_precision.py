"""Mixed precision in the loop of one rank (CPU autocast), run without Spark."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_torch_est import Checkpoint, Hook
from spark_torch_est.cluster.barrier import LocalBarrier
from spark_torch_est.cluster.worker import run_rank
from spark_torch_est.core.progress import Target
from spark_torch_est.core.protocol import IS_VALIDATION
from spark_torch_est.train.builtin_hooks import GradientClipping
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.hooks import normalize_hooks
from tests.helpers import LOCAL_LAUNCH, adam, arrow_batches, flat_weights, mlp, task_spec, train_locally

pytestmark = pytest.mark.compat  # each torch of the support matrix: autocast, GradScaler, exact resume
MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class Dtypes(Hook):
    """Records the dtypes of the outputs, losses and weights the hooks see."""

    def __init__(self):
        self.seen = {}

    def after_train_iter(self, outputs, loss, model):
        self.seen.setdefault("train_outputs", str(outputs.dtype))
        self.seen.setdefault("loss", str(loss.dtype))
        self.seen.setdefault("weights", sorted({str(p.dtype) for p in model.parameters()}))

    def after_val_iter(self, outputs):
        self.seen.setdefault("val_outputs", str(outputs.dtype))

    def state_dict(self):
        return {"seen": dict(self.seen)}


def _with_validation(rows: int = 200) -> list[pa.RecordBatch]:
    batch = arrow_batches(rows)[0]  # pyarrow 14 (the oldest row) has no RecordBatch.append_column
    return [pa.RecordBatch.from_arrays([*batch.columns, pa.array([i % 5 == 0 for i in range(rows)])],
                                       names=[*batch.schema.names, IS_VALIDATION])]


@pytest.mark.parametrize("precision", list(MIXED))
def test_training_and_validation_run_under_autocast_and_the_weights_stay_float32(precision):
    spec = task_spec(Target(epoch=2), hooks={"dtypes": Dtypes()}, precision=precision)
    checkpoint = Checkpoint.from_bytes(run_rank(spec, LOCAL_LAUNCH, iter(_with_validation()), LocalBarrier()))
    seen = checkpoint.hook_states["dtypes"]["seen"]
    low = str(MIXED[precision])
    assert seen == {"train_outputs": low, "val_outputs": low, "loss": "torch.float32", "weights": ["torch.float32"]}
    assert {v.dtype for v in checkpoint.model_state.values()} == {torch.float32}
    assert checkpoint.precision == precision
    assert checkpoint.history[-1]["val_loss"] < checkpoint.history[0]["val_loss"]  # it learns


@pytest.mark.parametrize("precision", ["32", *MIXED])
def test_two_plus_two_epochs_equal_four_bitwise_under_each_precision(precision):
    whole = train_locally(Target(epoch=4), precision=precision)
    half = train_locally(Target(epoch=2), precision=precision)
    resumed = train_locally(Target(epoch=4), resume=half.to_bytes(), precision=precision)
    np.testing.assert_array_equal(flat_weights(whole), flat_weights(resumed))
    assert resumed.scaler_state == whole.scaler_state
    unscaled = train_locally(Target(epoch=4), precision="32")
    changed = not np.array_equal(flat_weights(whole), flat_weights(unscaled))
    assert precision == "32" or changed, "autocast changed nothing"


class Scale(Hook):
    """Records the scale the run's scaler starts each fit with."""

    def __init__(self):
        self.scales = []

    def before_run(self, scaler):
        self.scales.append(scaler.get_scale())

    def state_dict(self):
        return {"scales": list(self.scales)}

    def load_state_dict(self, state):
        self.scales = list(state["scales"])


def test_the_gradient_scalers_state_is_in_the_checkpoint_and_resumed():
    half = train_locally(Target(epoch=2), hooks={"scale": Scale()}, precision="16-mixed")
    assert set(half.scaler_state) >= {"scale", "_growth_tracker"}
    assert half.scaler_state["scale"] < 65536.0, "overflowing steps backed the scale off from its start"
    resumed = train_locally(Target(epoch=4), resume=half.to_bytes(), hooks={"scale": Scale()}, precision="16-mixed")
    assert resumed.hook_states["scale"]["scales"] == [65536.0, half.scaler_state["scale"]]
    assert train_locally(Target(epoch=1), precision="bf16-mixed").scaler_state is None


def test_a_step_whose_scaled_gradients_overflow_is_skipped_and_the_scale_backs_off():
    class Huge(Hook):
        def before_backward(self, loss, global_step):
            return loss * 1e30 if global_step == 0 else None  # finite in float32, inf once scaled

    checkpoint = train_locally(Target(epoch=1, global_step=1), hooks={"huge": Huge()}, precision="16-mixed")
    fresh = train_locally(Target(epoch=1, global_step=0), precision="16-mixed")
    np.testing.assert_array_equal(flat_weights(checkpoint), flat_weights(fresh))  # the step changed no weight
    assert checkpoint.scaler_state["scale"] == 32768.0


class GradientNorms(Hook):
    """Records the gradient norm after backward and after the hooks before it (clipping)."""

    def __init__(self):
        self.after_backward_norms, self.clipped_norms = [], []

    def after_backward(self, model):
        self.after_backward_norms.append(_grad_norm(model))

    def before_optimizer_step(self, model):
        self.clipped_norms.append(_grad_norm(model))

    def state_dict(self):
        return {"after_backward": self.after_backward_norms, "clipped": self.clipped_norms}


def _grad_norm(model: torch.nn.Module) -> float:
    return float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm())


def test_hooks_see_and_clip_the_true_gradients_under_a_gradient_scaler():
    def norms(precision: str, clip: float | None) -> dict:
        hooks = {**({"clip": GradientClipping(max_norm=clip)} if clip else {}), "norms": GradientNorms()}
        return train_locally(Target(epoch=1, global_step=8), hooks=hooks, precision=precision).hook_states["norms"]

    plain, scaled = norms("32", None), norms("16-mixed", None)
    finite = [n for n in scaled["after_backward"] if np.isfinite(n)]  # the first steps overflow and are skipped
    assert finite and max(finite) < 2 * max(plain["after_backward"]), (scaled, plain)  # not thousands of times more
    clipped = norms("16-mixed", 0.01)
    kept = [n for n in clipped["clipped"] if np.isfinite(n)]
    assert kept and all(n <= 0.01 * 1.001 for n in kept) and min(clipped["after_backward"]) > 0.1


class AmpStep(Hook):
    """A ``train_step`` override written with the usual torch AMP recipe."""

    def __init__(self):
        self.dtypes = []

    def train_step(self, model, batch, loss_fn, optimizer, scaler):
        inputs, labels = batch
        optimizer.zero_grad(set_to_none=True)
        outputs = model(inputs)
        loss = loss_fn(outputs, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        self.dtypes.append(str(outputs.dtype))
        return loss, outputs

    def state_dict(self):
        return {"dtypes": sorted(set(self.dtypes))}


@pytest.mark.parametrize("precision", ["32", *MIXED])
def test_a_train_step_override_runs_under_the_autocast_with_the_runs_scaler(precision):
    creators = Creators(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(), hooks=normalize_hooks({"amp": AmpStep()}))
    checkpoint = train_locally(Target(epoch=3), creators=creators, precision=precision)
    expected = str(MIXED.get(precision, torch.float32))
    assert checkpoint.hook_states["amp"]["dtypes"] == [expected]
    assert checkpoint.history[-1]["train_loss"] < checkpoint.history[0]["train_loss"] / 2
    assert (checkpoint.scaler_state is not None) == (precision == "16-mixed")
    if precision == "16-mixed":
        assert checkpoint.scaler_state["scale"] < 65536.0  # the override's overflows backed off the run's scaler
