"""strategy="fsdp" on one rank (the real loop, in-process): sharded checkpoints, their
folders, the checks of what is read back, and the driver's checks of a model."""

from __future__ import annotations

import io
import os
import pickle
import re
import time

import numpy as np
import pytest
import torch
from torch import nn

from spark_torch_est import Checkpoint
from spark_torch_est.checkpoints.storage import CheckpointDir
from spark_torch_est.cluster.failure import RankFailure
from spark_torch_est.core.progress import Interval, Target
from spark_torch_est.core.support import FSDP_CPU, installed
from spark_torch_est.errors import IncompatibleCheckpointError, InvalidInputError
from spark_torch_est.train.strategies.fsdp import check_shardable, load_metadata, shard_targets
from tests.helpers import mlp, train_locally

#: The tests that train: FSDP2 on CPU ranks (torch 2.7); an older torch is refused (test_support.py).
trains = pytest.mark.skipif(installed("torch") < FSDP_CPU.needs, reason="FSDP2 on CPU needs torch >= 2.7")


def _fsdp(tmp_path, target, resume=None, **fields):
    return train_locally(target, resume, strategy="fsdp", checkpoint_dir=str(tmp_path),
                         checkpoint_every=Interval(1, "ep"), **fields)


def _weights(checkpoint: Checkpoint) -> np.ndarray:
    return torch.cat([v.reshape(-1) for v in checkpoint.model_state.values()]).numpy()


@trains
def test_two_plus_two_epochs_equal_four_bitwise(tmp_path):
    whole = _fsdp(tmp_path / "whole", Target(epoch=4))
    half = _fsdp(tmp_path / "half", Target(epoch=2))
    resumed = _fsdp(tmp_path / "half", Target(epoch=4), resume=half.to_bytes())
    np.testing.assert_array_equal(_weights(whole), _weights(resumed))
    assert [e["epoch"] for e in resumed.history] == [1, 2, 3, 4]


@trains
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


@trains
def test_an_altered_metadata_file_is_refused(tmp_path):
    half = _fsdp(tmp_path, Target(epoch=1))
    with open(os.path.join(half.sharded["url"], ".metadata"), "ab") as handle:
        handle.write(b"x")
    with pytest.raises(RankFailure, match="SHA-256 differs"):
        _fsdp(tmp_path, Target(epoch=2), resume=half.to_bytes())


@trains
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
        load_metadata(pickle.dumps(print), "x/.metadata")


def _call(module: str, name: str, argument: str) -> bytes:
    """A pickle (protocol 4) that calls ``module``'s global ``name`` (looked up as pickle
    looks up a dotted name) with one string."""
    def text(value: str) -> bytes:
        return b"\x8c" + bytes([len(value.encode())]) + value.encode()
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(argument) + b"\x85R."


def _crafted(marker) -> dict[str, bytes]:
    """Pickles that touch ``marker`` when unpickled freely, each as a way in."""
    class Run:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    return {
        "__reduce__ to os.system": pickle.dumps(Run()),
        "a dotted name in DCP's own module": _call("torch.distributed.checkpoint.filesystem", "os.system",
                                                  f"touch {marker}"),
        "a dotted name in DCP's metadata module": _call("torch.distributed.checkpoint.metadata", "os.system",
                                                       f"touch {marker}"),
        "builtins.getattr": _call("builtins", "getattr", "x"),
        "a dotted torch name": _call("torch", "os.system", f"touch {marker}"),
    }


@pytest.mark.parametrize("way", ["__reduce__ to os.system", "a dotted name in DCP's own module",
                                 "a dotted name in DCP's metadata module", "builtins.getattr", "a dotted torch name"])
def test_a_crafted_metadata_runs_nothing_and_is_refused_naming_the_file(tmp_path, way):
    marker = tmp_path / "ran"
    with pytest.raises(IncompatibleCheckpointError, match=r"^folder/\.metadata refers to .*never holds"):
        load_metadata(_crafted(marker)[way], "folder/.metadata")
    assert not marker.exists()


def _forged(checkpoint: Checkpoint, metadata: bytes) -> Checkpoint:
    """``checkpoint`` with its folder's ``.metadata`` replaced by ``metadata`` and its digests
    made to match (what someone who can write checkpointDir can do)."""
    import hashlib

    folder = checkpoint.sharded["url"]
    with open(os.path.join(folder, ".metadata"), "wb") as handle:
        handle.write(metadata)
    digest = hashlib.sha256(metadata).hexdigest()
    sharded = {**checkpoint.sharded, "digest": digest, "files": {**checkpoint.sharded["files"], ".metadata": digest}}
    return Checkpoint({**checkpoint._state, "sharded": sharded})


@trains
def test_a_crafted_metadata_is_refused_on_the_driver_and_on_the_ranks_before_any_state(tmp_path):
    from spark_torch_est.train.strategies.fsdp import check_present

    half = _fsdp(tmp_path, Target(epoch=1))
    marker = tmp_path / "ran"
    forged = _forged(half, _crafted(marker)["a dotted name in DCP's own module"])
    where = os.path.join(half.sharded["url"], ".metadata")
    with pytest.raises(IncompatibleCheckpointError, match=f"^{re.escape(where)} refers to "
                                                          "torch.distributed.checkpoint.filesystem.os.system"):
        check_present(forged.sharded)  # the driver, before any job
    with pytest.raises(RankFailure) as ranks:
        _fsdp(tmp_path, Target(epoch=2), resume=forged.for_ranks().to_bytes())
    assert ranks.value.failure.message.startswith(f"IncompatibleCheckpointError: {where} refers to ")
    assert not marker.exists()


@trains
def test_the_metadata_torch_writes_is_built_from_the_allowed_globals_only(tmp_path):
    from spark_torch_est.train.strategies.fsdp import METADATA_GLOBALS

    half = _fsdp(tmp_path, Target(epoch=1))
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    blob = open(os.path.join(half.sharded["url"], ".metadata"), "rb").read()
    Recording(io.BytesIO(blob)).load()
    assert {(m, n) for m, n in seen if not isinstance(getattr(torch, n, None), torch.dtype)} <= METADATA_GLOBALS
    assert load_metadata(blob, "x").state_dict_metadata  # and it loads


@trains
def test_a_metadata_naming_a_file_out_of_its_folder_is_refused(tmp_path):
    half = _fsdp(tmp_path, Target(epoch=1))
    metadata = load_metadata(open(os.path.join(half.sharded["url"], ".metadata"), "rb").read(), "x")
    next(iter(metadata.storage_data.values())).relative_path = "../../outside.distcp"
    with pytest.raises(IncompatibleCheckpointError, match="names '../../outside.distcp' for its data"):
        load_metadata(pickle.dumps(metadata), "x")


@trains
@pytest.mark.timeout(60)
@pytest.mark.parametrize("strange", ["fifo", "/dev/zero", "symlink out"])
def test_a_part_that_is_not_a_regular_file_is_refused_at_once_naming_it(tmp_path, strange):
    half = _fsdp(tmp_path / "dir", Target(epoch=1))
    part = os.path.join(half.sharded["url"], "__0_0.distcp")
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(open(part, "rb").read())  # the same bytes: only where they lie is wrong
    os.remove(part)
    if strange == "fifo":
        os.mkfifo(part)
    else:
        os.symlink("/dev/zero" if strange == "/dev/zero" else outside, part)
    started = time.monotonic()
    with pytest.raises(RankFailure) as resumed:
        _fsdp(tmp_path / "dir", Target(epoch=2), resume=half.to_bytes())
    assert resumed.value.failure.message.startswith(
        "IncompatibleCheckpointError: __0_0.distcp of the sharded checkpoint is not a regular file")
    from spark_torch_est.persistence import saved_checkpoint

    with pytest.raises(IncompatibleCheckpointError, match=f"{re.escape(part)} is "):
        saved_checkpoint(half, str(tmp_path / "saved"))  # a save copies the folder
    assert not (tmp_path / "saved" / "sharded").exists()
    assert time.monotonic() - started < 30


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


@trains
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
