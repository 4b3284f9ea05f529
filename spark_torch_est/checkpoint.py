"""The checkpoint: everything a later fit needs to continue a run exactly.

A checkpoint is one dict of tensors and plain data, written with ``torch.save`` and read
with ``torch.load(weights_only=True)``, so loading one never runs code::

    format_version  int
    meta            {"run_id": str, "param_shapes": {name: [dims]}, "output_shape": [dims],
                     "label_kind": str, "num_features": int, "max_epochs": int, "world_size": int}
    progress        Progress.to_dict()
    history         [{"epoch": 1, "train_loss": ..., ...}, ...]
    partial_epoch   {"loss_sum": float, "count": int} of an epoch stopped mid-way
    model           model.state_dict() (CPU tensors)
    optimizer       optimizer.state_dict()
    scheduler       scheduler.state_dict() or None
    rng             one {"torch", "python", "numpy"} entry per rank
    hooks           {hook name: hook.state_dict()} from rank 0
"""

from __future__ import annotations

import io
from typing import Any, Iterator, Mapping

import torch

from spark_torch_est.errors import IncompatibleCheckpointError
from spark_torch_est.progress import Progress

__all__ = ["Checkpoint", "FORMAT_VERSION", "check_compatible", "iter_chunks"]

FORMAT_VERSION = 1
CHUNK_BYTES = 8 << 20
_REQUIRED = ("format_version", "meta", "progress", "history", "model", "optimizer", "rng", "hooks")


class Checkpoint:
    """A training state, loaded with ``weights_only=True``.

    Args:
        state: The checkpoint dict described in this module's docstring.

    Raises:
        IncompatibleCheckpointError: The dict lacks a required entry or has another format.
    """

    def __init__(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in _REQUIRED if k not in state]
        if missing:
            raise IncompatibleCheckpointError(
                f"not a spark_torch_est checkpoint: missing {', '.join(missing)}"
            )
        if state["format_version"] != FORMAT_VERSION:
            raise IncompatibleCheckpointError(
                f"checkpoint format_version {state['format_version']!r} is not supported "
                f"(this version reads {FORMAT_VERSION})"
            )
        self.state = dict(state)

    @property
    def progress(self) -> Progress:
        """Where the run stands."""
        return Progress.from_dict(self.state["progress"])

    @property
    def history(self) -> list[dict]:
        """Per-epoch metrics up to this checkpoint."""
        return [dict(entry) for entry in self.state["history"]]

    @property
    def meta(self) -> dict:
        """Shapes and settings recorded when the checkpoint was made."""
        return self.state["meta"]

    @property
    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict``."""
        return self.state["model"]

    @property
    def hook_states(self) -> dict[str, dict]:
        """``{hook name: state}`` saved from rank 0."""
        return self.state["hooks"]

    def to_bytes(self) -> bytes:
        """Serializes with ``torch.save``."""
        buffer = io.BytesIO()
        torch.save(self.state, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | memoryview) -> Checkpoint:
        """Loads a checkpoint weights-only.

        Raises:
            IncompatibleCheckpointError: The bytes are not a readable checkpoint.
        """
        try:
            state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises several types for corrupt or unsafe files
            raise IncompatibleCheckpointError(
                f"cannot read checkpoint ({type(error).__name__}: {str(error)[:300]})"
            ) from None
        if not isinstance(state, Mapping):
            raise IncompatibleCheckpointError(
                f"not a spark_torch_est checkpoint: it holds a {type(state).__name__}"
            )
        return cls(state)

    def save(self, path: str) -> None:
        """Writes to a local path or fsspec URL, atomically where the filesystem can rename."""
        from spark_torch_est.storage import write_atomic

        write_atomic(path, self.to_bytes())

    @classmethod
    def load(cls, path: str) -> Checkpoint:
        """Reads a checkpoint from a local path or fsspec URL."""
        from spark_torch_est.storage import read_bytes

        return cls.from_bytes(read_bytes(path))

    def __repr__(self) -> str:
        return f"Checkpoint({self.progress})"


def check_compatible(expected: Mapping[str, torch.Tensor], saved: Mapping[str, Any]) -> None:
    """Checks that a saved model state fits a model's ``state_dict``.

    Raises:
        IncompatibleCheckpointError: Names the missing, unexpected and reshaped entries.
    """
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [
        f"{k} {list(saved[k].shape)} -> {list(v.shape)}"
        for k, v in expected.items()
        if k in saved and tuple(saved[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or reshaped:
        parts = [
            f"{label}: {', '.join(items[:10])}{' ...' if len(items) > 10 else ''}"
            for label, items in (("missing", missing), ("unexpected", unexpected),
                                 ("shape differs (checkpoint -> model)", reshaped))
            if items
        ]
        raise IncompatibleCheckpointError(
            "the checkpoint does not fit the model; " + "; ".join(parts)
        )


def iter_chunks(blob: bytes, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """Splits bytes into views of at most ``size`` bytes."""
    view = memoryview(blob)
    for start in range(0, len(view), size):
        yield view[start:start + size]
