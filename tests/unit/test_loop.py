"""The loop of one rank, run without Spark through LocalBarrier (world size 1)."""

from __future__ import annotations

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_torch_est import Checkpoint, Hook
from spark_torch_est.creators import Creators
from spark_torch_est.data import FEATURES, LABEL
from spark_torch_est.failure import INPUT, USER, RankFailure
from spark_torch_est.hooks import normalize_hooks
from spark_torch_est.spec import Target, TaskSpec
from spark_torch_est.barrier import LocalBarrier
from spark_torch_est.worker import run_rank
from tests.helpers import adam, flat_weights, mlp, step_lr


def _batches(rows=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    y = (x.sum(axis=1) + 1.0).astype(np.float32)
    features = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8)
    return [pa.RecordBatch.from_arrays([features, pa.array(y)], [FEATURES, LABEL])]


def _run(target: Target, resume: bytes | None = None, hooks=None, rows=200) -> Checkpoint:
    creators = Creators(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(), scheduler=step_lr,
                        hooks=normalize_hooks(hooks), config={"dropout": 0.3})
    spec = TaskSpec(job_id="unit/", run_id="r", payload=cloudpickle.dumps(creators), resume=resume, target=target,
                    world_size=1, batch_size=16, seed=3, store_host=None, store_port=None, timeout_s=30)
    return Checkpoint.from_bytes(run_rank(spec, iter(_batches(rows)), LocalBarrier()))


def _weights(checkpoint: Checkpoint) -> np.ndarray:
    return torch.cat([v.reshape(-1) for v in checkpoint.model_state.values()]).numpy()


def test_two_plus_two_epochs_equal_four_bitwise():
    whole = _run(Target(max_epochs=4, epoch=4))
    half = _run(Target(max_epochs=4, epoch=2))
    resumed = _run(Target(max_epochs=4, epoch=4), resume=half.to_bytes())
    np.testing.assert_array_equal(_weights(whole), _weights(resumed))
    assert resumed.progress == whole.progress
    assert [e["epoch"] for e in resumed.history] == [1, 2, 3, 4]


def test_batch_durations_that_end_mid_epoch_resume_exactly():
    whole = _run(Target(max_epochs=3, epoch=3))          # 13 steps per epoch
    part = _run(Target(max_epochs=3, epoch=3, global_step=20))
    assert (part.progress.epoch, part.progress.batch_in_epoch) == (1, 7)
    resumed = _run(Target(max_epochs=3, epoch=3), resume=part.to_bytes())
    np.testing.assert_array_equal(_weights(whole), _weights(resumed))
    assert resumed.history[1]["train_loss"] == pytest.approx(whole.history[1]["train_loss"], rel=1e-9)


def test_hook_exception_names_hook_stage_and_rank():
    class Boom(Hook):
        def after_train_iter(self, global_step):
            if global_step == 3:
                raise ValueError("boom at 3")

    with pytest.raises(RankFailure) as error:
        _run(Target(max_epochs=1, epoch=1), hooks={"boom": Boom()})
    failure = error.value.failure
    assert (failure.kind, failure.hook, failure.stage, failure.rank) == (USER, "boom", "after_train_iter", 0)
    assert "boom at 3" in failure.message and "ValueError" in failure.traceback


def test_an_empty_partition_is_an_input_error():
    creators = Creators(model=mlp, optimizer=adam, loss=torch.nn.MSELoss())
    spec = TaskSpec(job_id="unit/", run_id="r", payload=cloudpickle.dumps(creators), resume=None,
                    target=Target(1, 1), world_size=1, batch_size=4, seed=0, store_host=None,
                    store_port=None, timeout_s=30)
    with pytest.raises(RankFailure) as error:
        run_rank(spec, iter([]), LocalBarrier())
    assert error.value.failure.kind == INPUT and "no training rows" in error.value.failure.message


def test_flat_weights_helper_sees_every_parameter():
    assert flat_weights(mlp({})).size == 8 * 16 + 16 + 16 + 1


def test_a_creator_from_a_module_executors_cannot_import_gets_a_hint(tmp_path, monkeypatch):
    import importlib
    import sys

    (tmp_path / "driver_only_module.py").write_text("import torch\ndef make(config):\n    return torch.nn.Linear(8, 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("driver_only_module")
    payload = cloudpickle.dumps(Creators(model=module.make, optimizer=adam, loss=torch.nn.MSELoss()))
    del sys.modules["driver_only_module"]
    sys.path.remove(str(tmp_path))  # now this process is an executor without the module
    spec = TaskSpec(job_id="unit/", run_id="r", payload=payload, resume=None, target=Target(1, 1), world_size=1,
                    batch_size=4, seed=0, store_host=None, store_port=None, timeout_s=30)
    with pytest.raises(RankFailure) as error:
        run_rank(spec, iter(_batches()), LocalBarrier())
    failure = error.value.failure
    assert failure.kind == USER and failure.stage == "setup"
    assert "'driver_only_module'" in failure.message and "register_pickle_by_value" in failure.message


def test_a_model_that_does_not_fit_the_features_is_a_user_error_at_setup():
    creators = Creators(model=lambda c: torch.nn.Linear(10, 1), optimizer=adam, loss=torch.nn.MSELoss())
    spec = TaskSpec(job_id="unit", run_id="r", payload=cloudpickle.dumps(creators), resume=None, target=Target(1, 1),
                    world_size=1, batch_size=4, seed=0, store_host=None, store_port=None, timeout_s=30)
    with pytest.raises(RankFailure) as error:
        run_rank(spec, iter(_batches()), LocalBarrier())
    failure = error.value.failure
    assert (failure.kind, failure.stage) == (USER, "setup") and "mat1 and mat2" in failure.message


def test_slow_imports_run_in_the_background_only_when_missing():
    import sys

    from spark_torch_est.worker import _import_in_background

    assert _import_in_background(("torch", "pyarrow")) is None  # a reused worker starts no thread
    sys.modules.pop("colorsys", None)
    thread = _import_in_background(("no_such_module_ste", "colorsys"))  # a failure is only logged
    thread.join(30)
    assert not thread.is_alive() and "colorsys" in sys.modules


class _Held:
    """Stands in for a DDP model: weakly referenceable, owned by whatever holds it."""


@pytest.fixture
def lone_process_group():
    """A real one-rank gloo group for ``_teardown`` to destroy; undone if a test fails."""
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    gc.unfreeze()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_teardown_frees_a_model_that_only_old_garbage_still_reaches(lone_process_group, caplog):
    import gc
    import weakref

    import torch.distributed as dist

    from spark_torch_est import worker

    old = _Held()
    old.cycle = old  # cyclic garbage-to-be that predates training: frozen below
    gc.freeze()
    model = _Held()
    old.model = model  # training hands the old object a reference, then both are dropped
    ref = weakref.ref(model)
    del old, model
    gc.collect()
    assert ref() is not None, "a frozen object keeps it out of the quick collection"
    kept = len(worker._KEPT_ALIVE)
    worker._teardown(clean=True, ddp=[ref])
    assert ref() is None, "freed before the process group, after the full collection"
    assert not dist.is_initialized() and len(worker._KEPT_ALIVE) == kept
    assert "still referenced" not in caplog.text


def test_teardown_keeps_a_model_a_global_still_holds_instead_of_freeing_it_later(lone_process_group, caplog):
    import weakref

    import torch.distributed as dist

    from spark_torch_est import worker

    holder = [_Held()]  # a hook's global, say
    ref = weakref.ref(holder[0])
    worker._teardown(clean=True, ddp=[ref])
    holder.clear()
    assert ref() is not None and ref() in worker._KEPT_ALIVE
    assert not dist.is_initialized() and "still referenced after training" in caplog.text
    worker._KEPT_ALIVE.remove(ref())
