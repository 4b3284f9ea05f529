"""The estimator's driver-side checks that need no Spark: Params and creators (see planning.py)."""

import pytest
import torch

from spark_torch_est import TorchEstimator
from spark_torch_est.core.progress import Target
from spark_torch_est.core.support import FSDP, Feature, installed
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.planning import check_creators, check_params, task_spec
from spark_torch_est.train.strategies import DDP, STRATEGIES
from tests.helpers import features_schema, linear_model, sgd


def _est(**kw):
    settings = dict(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss())
    settings.update(kw)
    return TorchEstimator(**settings)


@pytest.mark.parametrize("params, message", [
    ({"batchSize": 0}, "batchSize must be at least 1, got 0"),
    ({"maxEpochs": 0}, "maxEpochs must be at least 1"),
    ({"numWorkers": -1}, "numWorkers must be at least 1"),
    ({"maxRetries": -1}, "maxRetries must be at least 0"),
    ({"timeout": 0.0}, "timeout must be a positive"),
    ({"checkpointInterval": "often"}, "checkpointInterval must look like"),
    ({"checkpointInterval": "1000sp"}, "checkpointInterval counts epochs or batches"),
    ({"minWorkers": 0}, r"minWorkers must be between 1 and numWorkers=2 \(or None for numWorkers\), got 0"),
    ({"minWorkers": 3}, r"minWorkers must be between 1 and numWorkers=2 .*got 3"),
    ({"minWorkers": 5, "numWorkers": 4}, "numWorkers=4 .*got 5"),
    ({"strategy": "zero3"}, "strategy must be one of 'ddp', 'fsdp', got 'zero3'"),
    pytest.param({"strategy": "fsdp"}, 'strategy="fsdp" writes sharded checkpoints.*checkpointDir=None',
                 marks=pytest.mark.skipif(installed("torch") < FSDP.needs, reason="an older torch is refused first")),
    ({"precision": "fp8"}, "precision must be one of '32', 'bf16-mixed', '16-mixed', got 'fp8'"),
])
def test_params_out_of_range(params, message):
    with pytest.raises(InvalidInputError, match=message):
        check_params(_est(**params))


class _Piped(DDP):
    """A strategy as a new module would declare it: its name, its releases, its checks."""

    name = "piped"
    needs = (Feature('strategy="piped"', "torch", (99, 0), "torch.pipes"),)
    sharded = True

    @classmethod
    def check_model(cls, model, shard_modules):
        raise InvalidInputError(f"piped cannot split {type(model).__name__}")


def test_a_new_strategy_is_one_class_in_the_registry_and_the_driver_asks_it(monkeypatch, tmp_path):
    with pytest.raises(InvalidInputError, match="strategy must be one of 'ddp', 'fsdp', got 'piped'"):
        check_params(_est(strategy="piped"))
    monkeypatch.setitem(STRATEGIES, "piped", _Piped)
    with pytest.raises(InvalidInputError, match=r'strategy="piped" needs torch >= 99.0 \(torch.pipes\)'):
        check_params(_est(strategy="piped"))
    monkeypatch.setattr(_Piped, "needs", ())
    with pytest.raises(InvalidInputError, match='strategy="piped" writes sharded checkpoints.*checkpointDir=None'):
        check_params(_est(strategy="piped"))
    est = _est(strategy="piped", checkpointDir=str(tmp_path))
    check_params(est)
    with pytest.raises(InvalidInputError, match="piped cannot split Linear"):
        check_creators(est, est._run_creators, None)


def test_param_accessors_and_copy_keep_values():
    est = _est(batchSize=32, maxEpochs=3)
    assert (est.getBatchSize(), est.getMaxEpochs(), est.getNumWorkers()) == (32, 3, 2)
    est.setBatchSize(8)
    copied = est.copy({est.maxEpochs: 9})
    assert (copied.getBatchSize(), copied.getMaxEpochs(), est.getMaxEpochs()) == (8, 9, 3)


@pytest.mark.parametrize("creators, message", [
    ({"model": lambda c: "not a module"}, "returned str, not a torch.nn.Module"),
    ({"model": lambda c: 1 / 0}, "model creator raised ZeroDivisionError"),
    ({"optimizer": lambda m, c: None}, "not a torch.optim.Optimizer"),
    ({"scheduler": lambda o, c: object()}, "no step\\(\\)/state_dict\\(\\)"),
    ({"loss": None}, "needs loss"),
])
def test_bad_creators_fail_on_the_driver(creators, message):
    with pytest.raises(InvalidInputError, match=message):
        est = _est(**creators)
        check_creators(est, est._run_creators, None)


def test_unpicklable_creators_are_reported():
    import threading

    lock = threading.Lock()
    est = _est(model=lambda c: (lock, torch.nn.Linear(1, 1))[1])
    with pytest.raises(InvalidInputError, match="cannot be pickled"):
        task_spec(est, est._run_creators, Target(epoch=1), features_schema(1), None, None)


def test_copy_with_a_hook_that_cannot_be_copied_names_the_fix():
    import threading

    from spark_torch_est import Hook

    class Locked(Hook):
        def __init__(self) -> None:
            self.lock = threading.Lock()

    est = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), hooks=[Locked()])
    with pytest.raises(InvalidInputError, match="copy\\(\\) copies the hooks, and one of them cannot be copied "
                                                "\\(TypeError: .*lock.*\\); give it __deepcopy__"):
        est.copy()


def test_config_is_a_param_that_param_maps_and_copies_vary():
    est = _est(config={"lr": 0.1})
    assert est.getParam("config") is est.config and est.getConfig() == {"lr": 0.1}
    est.getConfig()["lr"] = 5.0  # a copy: changing it changes nothing
    copied = est.copy({est.config: {"lr": 0.01, "width": 4}})
    assert copied.getConfig() == {"lr": 0.01, "width": 4} and est.getConfig() == {"lr": 0.1}
    assert copied._run_creators.config == {"lr": 0.01, "width": 4}  # what the creators and the tasks get
    assert est.setConfig({"lr": 0.2}) is est and est.getConfig() == {"lr": 0.2}
    assert _est().getConfig() == {}


@pytest.mark.parametrize("config, message", [
    (3, "config must be a dict, got int: 3"),
    ({"act": torch.nn.ReLU}, "config must be a plain dict of JSON values .*got \\{'act': <class"),
])
def test_a_config_that_cannot_be_a_param_is_refused_by_name(config, message):
    with pytest.raises(InvalidInputError, match=message):
        _est(config=config)
    with pytest.raises(InvalidInputError, match=message):
        _est().setConfig(config)


def test_an_estimator_saved_before_config_was_a_param_loads_with_its_config():
    import cloudpickle

    from spark_torch_est.train.creators import Creators

    old = Creators(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), config={"lr": 0.3})
    files = {"creators.pkl": cloudpickle.dumps((old, {}, set()))}  # what creators.pkl held then
    loaded = TorchEstimator._from_files(files.get, "unused: no checkpoint")
    assert loaded.getConfig() == {"lr": 0.3} and loaded._run_creators.config == {"lr": 0.3}


def test_a_fit_continues_its_run_only_from_the_runs_newest_point(tmp_path):
    from spark_torch_est.checkpoints.storage import CheckpointDir
    from spark_torch_est.core.progress import Parent, Target
    from spark_torch_est.planning import run_of
    from tests.helpers import train_locally

    own = train_locally(Target(epoch=1), rows=64)
    earlier_step = own.progress.global_step
    newer = train_locally(Target(epoch=2), own.to_bytes(), rows=64)  # the same run, one epoch on
    assert run_of(None, None, None)[1] is None
    assert run_of(own, own, str(tmp_path)) == (own.run_id, None)  # est.fit(df): the same run
    assert run_of(newer, own, str(tmp_path)) == (own.run_id, None)  # a failed fit's newest file of the run
    for start, mine in ((own, None), (own, newer)):  # a fresh estimator; an earlier point of its run
        run_id, parent = run_of(start, mine, str(tmp_path))
        assert run_id != own.run_id and parent == Parent(own.run_id, earlier_step)
    CheckpointDir(str(tmp_path), run_id=own.run_id).write(newer.to_bytes(), 2, newer.progress.global_step)
    run_id, parent = run_of(own, own, str(tmp_path))  # a failed fit went on past it: its files stay
    assert run_id != own.run_id and parent == Parent(own.run_id, earlier_step)
    branched = train_locally(Target(epoch=2), own.to_bytes(), rows=64, run_id=run_id, parent=parent)
    assert run_of(branched, branched, None) == (run_id, parent)  # a branch's next fit keeps its parent
    assert branched.parent == parent and branched.history[1]["branch_of"] == f"{own.run_id[:12]}@{earlier_step}"


def test_two_copies_of_one_saved_run_continue_it_into_one_folder_once(tmp_path):
    """Two estimators loaded from one save hold two copies of the run's newest point: the
    first to claim it in checkpointDir continues the run (again, when its fit is retried),
    the other branches, before either has written a file."""
    from spark_torch_est import Checkpoint
    from spark_torch_est.core.progress import Parent, Target
    from spark_torch_est.planning import run_of
    from tests.helpers import train_locally

    blob = train_locally(Target(epoch=1), rows=64).to_bytes()
    first, second = Checkpoint.from_bytes(blob), Checkpoint.from_bytes(blob)
    step = first.progress.global_step
    assert run_of(first, first, str(tmp_path)) == (first.run_id, None)
    run_id, parent = run_of(second, second, str(tmp_path))
    assert run_id != first.run_id and parent == Parent(first.run_id, step)
    assert run_of(first, first, str(tmp_path)) == (first.run_id, None)  # the first copy's fit, retried
    assert run_of(second, second, None) == (second.run_id, None)  # no folder shared: nothing to claim


def test_a_copy_whose_fit_failed_gives_its_claim_back_so_a_later_copy_continues_the_run(tmp_path):
    """A fit that claimed a run's point and then failed (refused for slots, interrupted,
    crashed before its first checkpoint) gives the claim back: an estimator loaded from the
    same save later continues the run instead of branching from it forever."""
    from spark_torch_est import Checkpoint
    from spark_torch_est.core.progress import Target
    from spark_torch_est.planning import release_claim, run_of
    from tests.helpers import train_locally

    blob = train_locally(Target(epoch=1), rows=64).to_bytes()
    failed, later = Checkpoint.from_bytes(blob), Checkpoint.from_bytes(blob)
    assert run_of(failed, failed, str(tmp_path)) == (failed.run_id, None)
    release_claim(later, later, str(tmp_path))  # not its claim: nothing is given back
    assert run_of(later, later, str(tmp_path))[0] != failed.run_id
    release_claim(failed, failed, str(tmp_path))
    assert run_of(later, later, str(tmp_path)) == (failed.run_id, None)
