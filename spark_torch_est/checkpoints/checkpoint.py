"""[both] The checkpoint: everything a later fit needs to continue a run exactly.

:class:`Checkpoint` owns its format: the loop builds one with :meth:`Checkpoint.build`
and reads it back through typed properties; nobody else touches the dict. It is written
with ``torch.save`` and read with ``torch.load(weights_only=True)``, so loading one never
runs code::

    format_version  int (2)
    run_id          str: the run this state belongs to (kept across its fits)
    fit_id          str: the fit that wrote it
    progress        Progress.to_dict()
    history         [{"epoch": 1, "train_loss": ..., ...}, ...]
    partial_epoch   {"loss_sum": float, "count": float} of an epoch stopped mid-way
    epoch_rows      training rows of the epoch in progress, all ranks together
    world_size      ranks of the fit that wrote it
    shards          the run's logical shards (its first world size; an epoch's order is made of them)
    data_source     which rows each rank read: "files:" and the digest of a table's file parts
                    (rows placed by the files' order), "spark:positions" (through Spark, placed
                    by the training frame's logical partitions) or "spark" (placed by hashing);
                    older checkpoints: a bare digest (file parts whose rows were placed by
                    hashing), "spark:partitions" (logical partitions of Spark's round robin)
    seed            the seed of the epoch orders (the ``seed`` Param)
    optimizer_made  each param group's hyper-parameters as the optimizer creator made them (before
                    the state was restored and before a scheduler changed them)
    outputs         {"shape": [dims per row], "label_kind": "int" | "float"}
    inputs          {"schema": the input schema (see :mod:`spark_torch_est.core.schema`),
                     "rows": each input's row shape as trained (None: padded per batch)}
    model           model.state_dict() (CPU tensors)
    optimizer       optimizer.state_dict()
    scheduler       scheduler.state_dict() or None
    rng             one float64 tensor per rank (see :mod:`spark_torch_est.core.rng`)
    hooks           {hook name: hook.state_dict()} from rank 0
    precision       the ``precision`` Param the state was trained under (absent: "32")
    scaler          the gradient scaler's state_dict under "16-mixed", else None (may be absent)
    strategy        the ``strategy`` Param of the run, "ddp" or "fsdp" (absent: "ddp")
    parent          {"run_id": str, "global_step": int}: the run and the point this run branched
                    from (see :func:`spark_torch_est.planning.run_of`), or None (may be absent)
    sharded         under "fsdp": {"url": the folder of every rank's part, "digest": SHA-256 of its
                    .metadata, "files": {name: SHA-256} of every file in it} (see
                    :mod:`spark_torch_est.train.strategies.fsdp`); the model and optimizer states
                    live there, ``optimizer`` is {} and ``model`` is {} in the checkpoints written
                    to checkpointDir, the full weights gathered at the end of a fit in the one the
                    driver keeps. Absent or None under "ddp"
    lightning       a LightningModule's run: what it keeps of Lightning's own checkpoint (optimizer and
                    scheduler states, loops, callbacks' state; see
                    :mod:`spark_torch_est.train.lightning.trainer`), the weights being ``model``. Absent
                    or None for a plain module

A checkpoint keeps the bytes it was read from, so handing it on (to the next fit, to a
file) never serializes it again.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from spark_torch_est.core.progress import Parent, Progress
from spark_torch_est.core.schema import InputSchema
from spark_torch_est.errors import IncompatibleCheckpointError

__all__ = ["Checkpoint", "FORMAT_VERSION", "check_compatible", "iter_chunks"]

FORMAT_VERSION = 2
CHUNK_BYTES = 8 << 20
_REQUIRED = ("format_version", "run_id", "fit_id", "progress", "history", "partial_epoch", "epoch_rows", "world_size",
             "data_source", "seed",
             "optimizer_made", "outputs", "inputs", "model", "optimizer", "scheduler", "rng", "hooks")


class Checkpoint:
    """A training state, loaded with ``weights_only=True``.

    Build one with :meth:`build` or :meth:`from_bytes`, not from a dict.

    Args:
        state: The checkpoint dict described in this module's docstring.
        blob: The bytes ``state`` was read from, if any.

    Raises:
        IncompatibleCheckpointError: The dict lacks a required entry or has another format.
    """

    def __init__(self, state: Mapping[str, Any], blob: bytes | None = None) -> None:
        if "format_version" in state and state["format_version"] != FORMAT_VERSION:
            raise IncompatibleCheckpointError(
                f"checkpoint format_version {state['format_version']!r} is not supported "
                f"(this version reads {FORMAT_VERSION}); it was written by another version of spark_torch_est"
            )
        missing = [k for k in _REQUIRED if k not in state]
        if missing:
            raise IncompatibleCheckpointError(f"not a spark_torch_est checkpoint: missing {', '.join(missing)}")
        self._state = dict(state)
        self._blob = blob
        self.holder = uuid.uuid4().hex  # this copy in memory: what claims the run's next point (see planning.run_of)

    @classmethod
    def build(cls, *, run_id: str, fit_id: str, progress: Progress, history: list[dict],
              partial_loss: tuple[float, float], epoch_rows: int, world_size: int, data_source: str, seed: int,
              optimizer_made: list[dict], output_shape: list[int],
              label_kind: str, input_schema: dict, input_rows: list[list[int] | None],
              model: Mapping[str, torch.Tensor], optimizer: dict, scheduler: dict | None,
              rng: list[torch.Tensor], hooks: dict[str, dict], precision: str = "32",
              scaler: dict | None = None, strategy: str = "ddp",
              sharded: dict | None = None, parent: Parent | None = None,
              shards: int | None = None, lightning: dict | None = None) -> Checkpoint:
        """A checkpoint of the state a rank trained (tensors already on the CPU)."""
        return cls({
            "format_version": FORMAT_VERSION, "run_id": run_id, "fit_id": fit_id, "progress": progress.to_dict(),
            "history": history, "partial_epoch": {"loss_sum": float(partial_loss[0]), "count": float(partial_loss[1])},
            "epoch_rows": int(epoch_rows), "world_size": int(world_size), "data_source": data_source,
            "shards": int(shards if shards is not None else world_size),
            "seed": int(seed),
            "optimizer_made": optimizer_made,
            "outputs": {"shape": list(output_shape), "label_kind": label_kind},
            "inputs": {"schema": input_schema, "rows": input_rows},
            "model": dict(model), "optimizer": optimizer, "scheduler": scheduler, "rng": list(rng), "hooks": hooks,
            "precision": precision, "scaler": scaler, "strategy": strategy, "sharded": sharded,
            "parent": {"run_id": parent.run_id, "global_step": parent.global_step} if parent is not None else None,
            **({"lightning": lightning} if lightning is not None else {}),
        })

    # ------------------------------------------------------------------ properties

    @property
    def run_id(self) -> str:
        """The run this state belongs to."""
        return self._state["run_id"]

    @property
    def fit_id(self) -> str:
        """The fit that wrote this state."""
        return self._state["fit_id"]

    @property
    def progress(self) -> Progress:
        """Where the run stands."""
        return Progress.from_dict(self._state["progress"])

    @property
    def lightning_state(self) -> dict[str, Any] | None:
        """A LightningModule's run: what it keeps of Lightning's checkpoint, or None."""
        return self._state.get("lightning")

    @property
    def history(self) -> list[dict]:
        """Per-epoch metrics up to this checkpoint."""
        return [dict(entry) for entry in self._state["history"]]

    @property
    def partial_loss(self) -> tuple[float, float]:
        """``(weighted loss sum, weight)`` of the epoch in progress, all ranks together."""
        partial = self._state["partial_epoch"]
        return float(partial["loss_sum"]), float(partial["count"])

    @property
    def epoch_rows(self) -> int:
        """Training rows (all ranks) of the epoch in progress when the state was saved."""
        return int(self._state["epoch_rows"])

    @property
    def world_size(self) -> int:
        """Ranks of the fit that saved the state."""
        return int(self._state["world_size"])

    @property
    def shards(self) -> int:
        """The run's logical shards (its first world size): an epoch's order is made of them."""
        return int(self._state.get("shards", self._state["world_size"]))

    @property
    def data_source(self) -> str:
        """Which rows each rank read in the fit that saved the state (see ``TaskSpec.source``)."""
        return self._state["data_source"]

    @property
    def seed(self) -> int:
        """The seed the epochs' row orders were drawn with."""
        return int(self._state["seed"])

    @property
    def optimizer_made(self) -> list[dict]:
        """Each param group's hyper-parameters as the optimizer creator made them."""
        return [dict(group) for group in self._state["optimizer_made"]]

    @property
    def output_shape(self) -> list[int]:
        """The model's output shape per row."""
        return list(self._state["outputs"]["shape"])

    @property
    def label_kind(self) -> str:
        """``"int"`` (class indices) or ``"float"`` labels."""
        return self._state["outputs"]["label_kind"]

    @property
    def input_schema(self) -> InputSchema:
        """The model's inputs: names, tensor types and row shapes."""
        return InputSchema.from_dict(self._state["inputs"]["schema"])

    @property
    def input_row_shapes(self) -> list[tuple[int, ...] | None]:
        """Each input's row shape as trained (after ``inputShapes``), or None for arrays
        padded per batch."""
        return [tuple(shape) if shape is not None else None for shape in self._state["inputs"]["rows"]]

    @property
    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict``."""
        return self._state["model"]

    @property
    def optimizer_state(self) -> dict:
        """The optimizer's ``state_dict``."""
        return self._state["optimizer"]

    @property
    def scheduler_state(self) -> dict | None:
        """The LR scheduler's ``state_dict``, or None without a scheduler."""
        return self._state["scheduler"]

    @property
    def rng_states(self) -> list[torch.Tensor]:
        """One RNG state tensor per rank (see :mod:`spark_torch_est.core.rng`)."""
        return list(self._state["rng"])

    @property
    def hook_states(self) -> dict[str, dict]:
        """``{hook name: state}`` saved from rank 0."""
        return self._state["hooks"]

    @property
    def precision(self) -> str:
        """The ``precision`` the state was trained under; ``evaluate`` and ``transform`` use it."""
        return self._state.get("precision", "32")

    @property
    def scaler_state(self) -> dict | None:
        """The gradient scaler's ``state_dict`` (``"16-mixed"``), or None."""
        return self._state.get("scaler")

    @property
    def strategy(self) -> str:
        """The ``strategy`` the run trains under (``"ddp"`` or ``"fsdp"``)."""
        return self._state.get("strategy", "ddp")

    @property
    def sharded(self) -> dict[str, Any] | None:
        """Where the run's sharded model and optimizer state is (``{"url", "digest",
        "files"}``: the folder, the SHA-256 of its ``.metadata`` and of every file in it;
        checkpoints of earlier releases have no ``"files"``), or None when this checkpoint
        holds them itself."""
        sharded = self._state.get("sharded")
        if sharded is None:
            return None
        if not _sharded_pointer(sharded):
            raise IncompatibleCheckpointError(f"malformed sharded checkpoint location: {sharded!r}"[:500])
        return {"url": sharded["url"], "digest": sharded["digest"], "files": dict(sharded.get("files") or {})}

    @property
    def parent(self) -> Parent | None:
        """The point this run branched from, or None for a run that started fresh."""
        parent = self._state.get("parent")
        return Parent(parent["run_id"], int(parent["global_step"])) if parent is not None else None

    def with_sharded_url(self, url: str) -> Checkpoint:
        """This checkpoint with its sharded state at ``url`` (a copy of the folder: the
        digests stay those it was saved with)."""
        return Checkpoint({**self._state, "sharded": {**self._state["sharded"], "url": url}})

    def for_ranks(self) -> Checkpoint:
        """What the ranks resume from: a sharded checkpoint without the full weights the
        driver keeps for the fitted model (each rank reads its part from the shards), any
        other checkpoint whole."""
        if self.sharded is None or not self.model_state:
            return self
        return Checkpoint({**self._state, "model": {}})

    # ---------------------------------------------------------------------- bytes

    def to_bytes(self) -> bytes:
        """The serialized checkpoint (the bytes it was read from, when it was read)."""
        if self._blob is None:
            buffer = io.BytesIO()
            torch.save(self._state, buffer)
            self._blob = buffer.getvalue()
        return self._blob

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
            raise IncompatibleCheckpointError(f"not a spark_torch_est checkpoint: it holds a {type(state).__name__}")
        checkpoint = cls(state, bytes(blob))
        _check_structure(checkpoint._state)
        return checkpoint

    def save(self, path: str) -> None:
        """Writes to a local path or fsspec URL, atomically where the filesystem can rename."""
        from spark_torch_est.checkpoints.storage import write_atomic

        write_atomic(path, self.to_bytes())

    @classmethod
    def load(cls, path: str) -> Checkpoint:
        """Reads a checkpoint from a local path or fsspec URL.

        Raises:
            IncompatibleCheckpointError: No readable checkpoint at ``path``.
        """
        from spark_torch_est.checkpoints.storage import read_bytes

        try:
            blob = read_bytes(path)
        except (OSError, ValueError) as error:  # missing file, bad URL, unknown protocol
            raise IncompatibleCheckpointError(f"cannot read a checkpoint from {path!r}: "
                                              f"{type(error).__name__}: {error}") from None
        return cls.from_bytes(blob)

    def __repr__(self) -> str:
        return f"Checkpoint({self.progress})"


def _check_structure(state: Mapping[str, Any]) -> None:
    """Checks every field's type and shape (not its values against a model), so that a
    damaged or forged file fails here, naming the field, rather than in a property or a job.

    Raises:
        IncompatibleCheckpointError: Names the first field that is not as :func:`Checkpoint.build` writes it.
    """
    from spark_torch_est.core import rng

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            value = repr(state.get(field.split(".")[0].split("[")[0]))
            raise IncompatibleCheckpointError(f"checkpoint field {field!r} must be {what}, got "
                                              f"{value[:200]}{'...' if len(value) > 200 else ''}")

    def integer(value: Any, low: int = 0) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for name in ("run_id", "fit_id", "data_source"):
        need(isinstance(state[name], str), name, "a string")
    for name, low in (("epoch_rows", 0), ("world_size", 1), ("seed", 0)):
        need(integer(state[name], low), name, f"an integer >= {low}")
    need(integer(state.get("shards", 1), 1), "shards", "an integer >= 1")
    progress = state["progress"]
    need(isinstance(progress, Mapping) and set(progress) == set(Progress.__dataclass_fields__)
         and all(integer(v) for v in progress.values()), "progress", "a dict of every counter >= 0 (Progress.to_dict)")
    history = state["history"]
    need(isinstance(history, list) and all(isinstance(e, Mapping) and integer(e.get("epoch"), 1)
                                           and all(isinstance(k, str) for k in e) for e in history),
         "history", "a list of dicts, each with its 1-based 'epoch'")
    partial = state["partial_epoch"]
    need(isinstance(partial, Mapping) and number(partial.get("loss_sum")) and number(partial.get("count")),
         "partial_epoch", "{'loss_sum': float, 'count': float}")
    need(isinstance(state["optimizer_made"], list) and all(isinstance(g, Mapping) for g in state["optimizer_made"]),
         "optimizer_made", "a list of dicts")
    outputs = state["outputs"]
    need(isinstance(outputs, Mapping) and isinstance(outputs.get("shape"), list)
         and all(integer(d, 1) for d in outputs["shape"]) and outputs.get("label_kind") in ("int", "float"),
         "outputs", "{'shape': [dims >= 1], 'label_kind': 'int' | 'float'}")
    inputs = state["inputs"]
    need(isinstance(inputs, Mapping) and isinstance(inputs.get("schema"), Mapping)
         and isinstance(inputs.get("rows"), list), "inputs", "{'schema': dict, 'rows': list}")
    try:
        columns = InputSchema.from_dict(dict(inputs["schema"])).columns
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise IncompatibleCheckpointError(f"checkpoint field 'inputs.schema' is not an input schema "
                                          f"({type(error).__name__}: {error})") from None
    need(len(inputs["rows"]) == len(columns)
         and all(r is None or (isinstance(r, list) and all(integer(d) for d in r)) for r in inputs["rows"]),
         "inputs.rows", f"{len(columns)} row shapes (lists of dims, or None)")
    need(isinstance(state["model"], Mapping) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in state["model"].items()),
         "model", "a state_dict: {name: tensor}")
    sharded, optimizer = state.get("sharded"), state["optimizer"]
    parent = state.get("parent")
    need(parent is None or isinstance(parent, Mapping) and isinstance(parent.get("run_id"), str)
         and integer(parent.get("global_step")), "parent", "None or {'run_id': str, 'global_step': int >= 0}")
    need(sharded is None or _sharded_pointer(sharded), "sharded",
         "None or {'url': str, 'digest': str, 'files': {name: str}}")
    lightning = state.get("lightning")
    need(lightning is None or isinstance(lightning, Mapping) and isinstance(lightning.get("loops"), Mapping)
         and isinstance(lightning.get("optimizer_states"), list), "lightning",
         "None or Lightning's checkpoint: {'loops': dict, 'optimizer_states': list, ...}")
    need(((sharded is not None or lightning is not None) and optimizer == {}) or isinstance(optimizer, Mapping)
         and isinstance(optimizer.get("state"), Mapping)
         and isinstance(optimizer.get("param_groups"), list)
         and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in optimizer["param_groups"]),
         "optimizer", "an optimizer state_dict: {'state': dict, 'param_groups': [{'params': [...], ...}]}")
    need(state["scheduler"] is None or isinstance(state["scheduler"], Mapping), "scheduler",
         "None or a scheduler state_dict")
    need(state.get("scaler") is None or isinstance(state["scaler"], Mapping), "scaler",
         "None or a GradScaler state_dict")
    states = state["rng"]
    need(isinstance(states, list) and len(states) >= 1 and all(isinstance(t, torch.Tensor) for t in states),
         "rng", "a list of one RNG state tensor per rank")
    for index, tensor in enumerate(states):
        try:
            rng.check(tensor)
        except ValueError as error:
            raise IncompatibleCheckpointError(f"checkpoint field 'rng[{index}]' is not an RNG state: {error}") from None
    hooks = state["hooks"]
    need(isinstance(hooks, Mapping) and all(isinstance(k, str) and isinstance(v, Mapping) for k, v in hooks.items()),
         "hooks", "{hook name: state dict}")


def check_compatible(expected: Mapping[str, torch.Tensor], saved: Mapping[str, Any]) -> None:
    """Checks that a saved model state fits a model's ``state_dict``. An entry of a lazy
    module not yet initialized (``nn.LazyLinear`` before its first forward) takes any
    shape: loading the state initializes it.

    Raises:
        IncompatibleCheckpointError: Names the missing, unexpected and reshaped entries.
    """
    from torch.nn.parameter import is_lazy

    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [
        f"{k} {list(saved[k].shape)} -> {list(v.shape)}"
        for k, v in expected.items()
        if k in saved and not is_lazy(v) and tuple(saved[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or reshaped:
        parts = [
            f"{label}: {', '.join(items[:10])}{' ...' if len(items) > 10 else ''}"
            for label, items in (("missing", missing), ("unexpected", unexpected),
                                 ("shape differs (checkpoint -> model)", reshaped))
            if items
        ]
        raise IncompatibleCheckpointError("the checkpoint does not fit the model; " + "; ".join(parts))


def iter_chunks(blob: bytes, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """Splits bytes into views of at most ``size`` bytes."""
    view = memoryview(blob)
    for start in range(0, len(view), size):
        yield view[start:start + size]


def _sharded_pointer(value: Any) -> bool:
    """Whether ``value`` is a sharded checkpoint's location as :class:`Checkpoint` keeps it."""
    files = value.get("files", {}) if isinstance(value, Mapping) else None
    return (isinstance(value, Mapping) and all(isinstance(value.get(k), str) for k in ("url", "digest"))
            and isinstance(files, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()))
