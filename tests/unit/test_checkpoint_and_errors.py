import io
import pickle

import pytest
import torch

from spark_torch_est import Checkpoint
from spark_torch_est.checkpoint import FORMAT_VERSION, check_compatible, iter_chunks
from spark_torch_est.errors import (IncompatibleCheckpointError, InvalidInputError, SparkTorchError,
                                    TrainingFailedError)
from spark_torch_est.failure import INPUT, SYSTEM, USER, Failure
from spark_torch_est.storage import CheckpointDir


def _state(**override):
    state = {"format_version": FORMAT_VERSION, "meta": {}, "progress": {"epoch": 1, "batch_in_epoch": 0,
             "global_step": 5, "samples": 50}, "history": [{"epoch": 1, "train_loss": 0.5}],
             "model": {"w": torch.ones(2)}, "optimizer": {}, "rng": [], "hooks": {}}
    state.update(override)
    return state


def test_round_trip_is_weights_only():
    checkpoint = Checkpoint(_state())
    loaded = Checkpoint.from_bytes(checkpoint.to_bytes())
    assert loaded.progress.global_step == 5 and torch.equal(loaded.model_state["w"], torch.ones(2))


def test_corrupt_and_foreign_bytes_are_incompatible():
    with pytest.raises(IncompatibleCheckpointError, match="cannot read"):
        Checkpoint.from_bytes(b"not a checkpoint")
    buffer = io.BytesIO()
    torch.save({"weights": torch.zeros(1)}, buffer)
    with pytest.raises(IncompatibleCheckpointError, match="missing"):
        Checkpoint.from_bytes(buffer.getvalue())
    with pytest.raises(IncompatibleCheckpointError, match="format_version"):
        Checkpoint(_state(format_version=99))


def test_pickled_code_is_refused():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(IncompatibleCheckpointError):
        Checkpoint.from_bytes(pickle.dumps(_state(hooks={"x": Evil()})))


def test_compatibility_names_the_mismatches():
    expected = {"a": torch.zeros(2, 3), "b": torch.zeros(1)}
    with pytest.raises(IncompatibleCheckpointError) as error:
        check_compatible(expected, {"a": torch.zeros(3, 3), "c": torch.zeros(1)})
    text = str(error.value)
    assert "missing: b" in text and "unexpected: c" in text and "a [3, 3] -> [2, 3]" in text


def test_chunks_reassemble():
    blob = bytes(range(256)) * 100
    assert b"".join(iter_chunks(blob, 1000)) == blob


def test_checkpoint_dir_keeps_the_newest_and_points_at_it(tmp_path):
    directory = CheckpointDir(str(tmp_path / "ckpts"), keep=2)
    for step in range(1, 5):
        directory.write(f"ckpt{step}".encode(), epoch=step, global_step=step * 10)
    assert directory.latest() == b"ckpt4"
    assert len(list((tmp_path / "ckpts").glob("ckpt-*.pt"))) == 2
    assert not list((tmp_path / "ckpts").glob("*.tmp-*"))


def test_failure_survives_wrapping_and_maps_to_the_right_error():
    failure = Failure(kind=USER, message="ValueError: boom", rank=1, stage="after_train_iter", hook="bad",
                      traceback="Traceback ...")
    wrapped = f"py4j.Py4JJavaError: An error occurred\n  {failure.marker()}\n\tat org.apache..."
    found = Failure.find(wrapped)
    assert found == failure
    error = found.to_error()
    assert isinstance(error, TrainingFailedError)
    assert (error.rank, error.stage, error.hook, error.retryable) == (1, "after_train_iter", "bad", False)
    assert "Traceback" in str(error)
    assert isinstance(Failure(INPUT, "x", 0, "ingest").to_error(), InvalidInputError)
    assert Failure(SYSTEM, "x", 0, "collective").to_error().retryable


def test_errors_pickle_with_their_fields():
    error = TrainingFailedError("boom", rank=1, stage="s", hook="h", remote_traceback="tb", retryable=True)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rank, copy.stage, copy.hook, copy.remote_traceback, copy.retryable) == (1, "s", "h", "tb", True)
    assert isinstance(copy, SparkTorchError)
