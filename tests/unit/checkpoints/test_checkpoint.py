"""The checkpoint owns its format: built and read through typed properties, weights-only."""

import io
import pickle

import pytest
import torch

from spark_torch_est import Checkpoint, Progress
from spark_torch_est.checkpoints.checkpoint import FORMAT_VERSION, check_compatible, iter_chunks
from spark_torch_est.core import rng
from spark_torch_est.errors import IncompatibleCheckpointError
from tests.helpers import features_schema


def _checkpoint(**override) -> Checkpoint:
    fields = dict(run_id="0123456789abcdef", fit_id="f", progress=Progress(epoch=1, global_step=5, samples=50),
                  history=[{"epoch": 1, "train_loss": 0.5}], partial_loss=(2.0, 4.0), epoch_rows=100, world_size=2,
                  data_source="spark",
                  seed=7, optimizer_made=[{"lr": 0.1}],
                  output_shape=[1], label_kind="float", input_schema=features_schema(8).to_dict(),
                  input_rows=[[8]], model={"w": torch.ones(2)},
                  optimizer={"state": {}, "param_groups": []}, scheduler=None,
                  rng=[rng.capture(torch.device("cpu"))], hooks={"h": {"n": 1}})
    fields.update(override)
    return Checkpoint.build(**fields)


def test_what_is_built_reads_back_through_its_properties_weights_only():
    loaded = Checkpoint.from_bytes(_checkpoint().to_bytes())
    assert loaded.progress == Progress(epoch=1, global_step=5, samples=50)
    assert (loaded.run_id, loaded.partial_loss, loaded.epoch_rows, loaded.world_size, loaded.seed,
            loaded.optimizer_made) == ("0123456789abcdef", (2.0, 4.0), 100, 2, 7, [{"lr": 0.1}])
    assert (loaded.output_shape, loaded.label_kind, loaded.input_schema) == ([1], "float", features_schema(8))
    assert torch.equal(loaded.model_state["w"], torch.ones(2)) and loaded.hook_states == {"h": {"n": 1}}
    assert loaded.history == [{"epoch": 1, "train_loss": 0.5}] and loaded.scheduler_state is None


def test_a_read_checkpoint_hands_on_its_own_bytes_without_serializing_again():
    blob = _checkpoint().to_bytes()
    loaded = Checkpoint.from_bytes(blob)
    assert loaded.to_bytes() == blob


def test_corrupt_and_foreign_bytes_are_incompatible():
    with pytest.raises(IncompatibleCheckpointError, match="cannot read"):
        Checkpoint.from_bytes(b"not a checkpoint")
    buffer = io.BytesIO()
    torch.save({"weights": torch.zeros(1), "format_version": FORMAT_VERSION}, buffer)
    with pytest.raises(IncompatibleCheckpointError, match="missing"):
        Checkpoint.from_bytes(buffer.getvalue())
    buffer = io.BytesIO()
    torch.save({"format_version": 1}, buffer)
    with pytest.raises(IncompatibleCheckpointError, match="format_version 1 is not supported"):
        Checkpoint.from_bytes(buffer.getvalue())


def test_pickled_code_is_refused(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    state = {"format_version": FORMAT_VERSION, "hooks": {"x": Evil()}}
    with pytest.raises(IncompatibleCheckpointError):
        Checkpoint.from_bytes(pickle.dumps(state, protocol=2))
    assert not marker.exists()


def test_a_missing_file_is_the_packages_error(tmp_path):
    with pytest.raises(IncompatibleCheckpointError, match="cannot read a checkpoint from .*nope"):
        Checkpoint.load(str(tmp_path / "nope.pt"))


def test_compatibility_names_the_mismatches():
    expected = {"a": torch.zeros(2, 3), "b": torch.zeros(1)}
    with pytest.raises(IncompatibleCheckpointError) as error:
        check_compatible(expected, {"a": torch.zeros(3, 3), "c": torch.zeros(1)})
    text = str(error.value)
    assert "missing: b" in text and "unexpected: c" in text and "a [3, 3] -> [2, 3]" in text


def test_chunks_reassemble():
    blob = bytes(range(256)) * 100
    assert b"".join(iter_chunks(blob, 1000)) == blob


def _tampered(field: str, value) -> bytes:
    state = torch.load(io.BytesIO(_checkpoint().to_bytes()), weights_only=True)
    if field == "inputs.schema":
        state["inputs"]["schema"]["columns"][0]["unknown"] = 1
    elif field == "model":
        state["model"]["w"] = value
    else:
        state[field] = value
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("field, value", [
    ("progress", "x"), ("progress", {"epoch": -1}), ("progress", {"epoch": 1, "batch_in_epoch": 0, "global_step": 5,
                                                                    "samples": 50}),
    ("history", [1, 2]), ("history", [{"train_loss": 1.0}]),
    ("rng", []), ("rng", [torch.zeros(3, dtype=torch.float64)]), ("optimizer", {}), ("scheduler", [1]),
    ("model", [1.0, 2.0]), ("inputs.schema", None), ("world_size", 0), ("outputs", {"shape": [1]}),
    ("hooks", {"h": 1}), ("run_id", 5), ("partial_epoch", {}), ("sharded", {"url": 1}), ("scaler", [1.0]),
])
def test_a_tampered_checkpoint_is_refused_naming_the_field(field, value):
    """format_version kept as 2: the structure is what tells."""
    named = "rng(\\[0\\])?" if field == "rng" else field
    with pytest.raises(IncompatibleCheckpointError, match=f"checkpoint field '{named}'"):
        Checkpoint.from_bytes(_tampered(field, value))
