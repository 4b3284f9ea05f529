"""strategy="fsdp" on one rank (the real loop, in-process): sharded checkpoints, their
folders, the checks of what is read back, and the driver's checks of a model."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from spark_torch_est import Checkpoint
from spark_torch_est.checkpoints.storage import CheckpointDir
from spark_torch_est.cluster.failure import RankFailure
from spark_torch_est.core.progress import Interval, Target
from spark_torch_est.errors import IncompatibleCheckpointError, InvalidInputError
from spark_torch_est.train.strategies.fsdp import _MetadataUnpickler, check_shardable, shard_targets
from tests.helpers import mlp, train_locally


def _fsdp(tmp_path, target, resume=None, **fields):
    return train_locally(target, resume, strategy="fsdp", checkpoint_dir=str(tmp_path),
                         checkpoint_every=Interval(1, "ep"), **fields)


def _weights(checkpoint: Checkpoint) -> np.ndarray:
    return torch.cat([v.reshape(-1) for v in checkpoint.model_state.values()]).numpy()


def test_two_plus_two_epochs_equal_four_bitwise(tmp_path):
    whole = _fsdp(tmp_path / "whole", Target(epoch=4))
    half = _fsdp(tmp_path / "half", Target(epoch=2))
    resumed = _fsdp(tmp_path / "half", Target(epoch=4), resume=half.to_bytes())
    np.testing.assert_array_equal(_weights(whole), _weights(resumed))
    assert [e["epoch"] for e in resumed.history] == [1, 2, 3, 4]


def test_the_driver_keeps_a_pointer_and_the_full_weights_not_the_optimizer(tmp_path):
    checkpoint = _fsdp(tmp_path, Target(epoch=2))
    assert checkpoint.strategy == "fsdp"
    assert checkpoint.optimizer_state == {}
    assert set(checkpoint.model_state) == set(mlp({"dropout": 0.3}).state_dict())
    folder = checkpoint.sharded["url"]
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp"]
    newest = CheckpointDir(str(tmp_path), run_id="0123456789abcdef").newest()
    on_disk = Checkpoint.from_bytes(newest.read())
    assert on_disk.model_state == {} and on_disk.sharded == checkpoint.sharded  # no weights in the small .pt


def test_an_altered_metadata_file_is_refused(tmp_path):
    half = _fsdp(tmp_path, Target(epoch=1))
    with open(os.path.join(half.sharded["url"], ".metadata"), "ab") as handle:
        handle.write(b"x")
    with pytest.raises(RankFailure, match="SHA-256 differs"):
        _fsdp(tmp_path, Target(epoch=2), resume=half.to_bytes())


def test_every_file_of_the_folder_is_checked_before_any_state_is_loaded(tmp_path):
    half = _fsdp(tmp_path / "a", Target(epoch=1))
    other = _fsdp(tmp_path / "b", Target(epoch=1), seed=99)  # another run of the same shapes
    assert set(half.sharded["files"]) == {".metadata", "__0_0.distcp"}
    shard = os.path.join(half.sharded["url"], "__0_0.distcp")
    original = open(shard, "rb").read()
    with open(shard, "wb") as handle:  # one flipped byte
        handle.write(original[:100] + bytes([original[100] ^ 1]) + original[101:])
    with pytest.raises(RankFailure) as flipped:
        _fsdp(tmp_path / "a", Target(epoch=2), resume=half.to_bytes())
    with open(shard, "wb") as handle:  # the part of another run, loaded silently before
        handle.write(open(os.path.join(other.sharded["url"], "__0_0.distcp"), "rb").read())
    with pytest.raises(RankFailure) as copied:
        _fsdp(tmp_path / "a", Target(epoch=2), resume=half.to_bytes())
    os.remove(shard)
    with pytest.raises(RankFailure) as missing:
        _fsdp(tmp_path / "a", Target(epoch=2), resume=half.to_bytes())
    for error, what in ((flipped, "differs"), (copied, "differs"), (missing, "is missing")):
        cause = error.value.failure.message
        assert cause.startswith("IncompatibleCheckpointError: __0_0.distcp of the sharded checkpoint " + what), cause
        assert len(cause[:cause.index(what)]) < 300


def test_a_metadata_file_naming_other_callables_is_not_unpickled():
    with pytest.raises(IncompatibleCheckpointError, match="builtins.print, which a DCP metadata file never holds"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(print))).load()


def test_old_and_unfinished_folders_are_pruned_with_their_checkpoints(tmp_path):
    directory = CheckpointDir(str(tmp_path), run_id="0123456789abcdef", keep=2)
    orphan = directory.sharded_url(9, 90)  # a save that never got its .pt
    os.makedirs(orphan)
    for epoch in range(1, 5):
        os.makedirs(directory.sharded_url(epoch, epoch * 10))
        directory.write(b"x", epoch, epoch * 10)
    names = sorted(os.listdir(tmp_path))
    assert [n for n in names if n.endswith(".dcp")] == [n[:-3] + ".dcp" for n in names if n.endswith(".pt")]
    assert len([n for n in names if n.endswith(".pt")]) == 2


class _NoParameters(nn.Module):
    def forward(self, x):
        return x


def test_the_driver_refuses_a_model_without_parameters():
    with pytest.raises(InvalidInputError, match=r'strategy="fsdp".*_NoParameters has none'):
        check_shardable(_NoParameters(), None)


def test_the_driver_refuses_an_unknown_class_and_lists_the_model_s():
    with pytest.raises(InvalidInputError, match=r"shardModules=\['Block'\].*'Linear'"):
        check_shardable(mlp({}), ["Block"])


def test_default_targets_are_the_children_holding_parameters():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    assert shard_targets(model, None) == [model[0], model[2]]
    assert shard_targets(model, ["Linear"]) == [model[0], model[2]]


def test_a_checkpoint_whose_parts_are_not_all_written_is_never_the_newest(tmp_path):
    directory = CheckpointDir(str(tmp_path), run_id="0123456789abcdef")
    os.makedirs(directory.sharded_url(1, 10))
    directory.write(b"x", 1, 10)
    unfinished = directory.sharded_url(2, 20)  # a rank was killed mid-save: no .pt was written
    os.makedirs(unfinished)
    open(os.path.join(unfinished, "__0_0.distcp"), "wb").close()
    assert directory.newest().global_step == 10 and directory.latest().global_step == 10


def test_ranks_resume_from_the_shards_without_the_full_weights_the_driver_keeps(tmp_path):
    whole = _fsdp(tmp_path / "whole", Target(epoch=2))
    half = _fsdp(tmp_path / "half", Target(epoch=1))
    assert half.model_state  # the driver's copy holds the gathered weights, for the fitted model
    lean = half.for_ranks()
    assert lean.model_state == {} and lean.sharded == half.sharded
    assert len(lean.to_bytes()) < len(half.to_bytes()) - 4 * sum(v.numel() for v in half.model_state.values()) // 2
    resumed = _fsdp(tmp_path / "half", Target(epoch=2), resume=lean.to_bytes())
    np.testing.assert_array_equal(_weights(whole), _weights(resumed))
    ddp = train_locally(Target(epoch=1))
    assert ddp.for_ranks() is ddp  # a whole checkpoint travels whole


def test_the_driver_checks_an_fsdp_model_without_allocating_its_weights():
    from spark_torch_est.train.creators import Creators
    from spark_torch_est.train.strategies.fsdp import model_to_check

    huge = Creators(model=lambda config: nn.Linear(20_000, 20_000), optimizer=None, loss=None)  # 1.6 GB of float32
    assert {p.device.type for p in model_to_check(huge).parameters()} == {"meta"}

    def reads_its_weights(config):
        model = nn.Linear(4, 2)
        model.weight.data[0, 0].item()  # values exist only on a real device
        return model

    built = model_to_check(Creators(model=reads_its_weights, optimizer=None, loss=None))
    assert {p.device.type for p in built.parameters()} == {"cpu"}
