"""[both] Sharded models (``strategy="fsdp"``): FSDP2 ``fully_shard`` and sharded checkpoints.

On the driver, :func:`check_shardable` refuses a model or a ``shardModules`` that cannot be
sharded, before any job. On the executors, the :class:`FSDP` strategy shards each rank's
model (:func:`shard_model`) and saves and loads the run's model and optimizer state
(:class:`ShardedState`) with ``torch.distributed.checkpoint`` (DCP): every rank writes its
own part, into one folder per checkpoint under ``checkpointDir``::

    ckpt-3f9c0a1b2d4e-ep000002-ba000000000040.dcp/   # one folder per checkpoint
        __0_0.distcp  __1_0.distcp                   # each rank's shards
        .metadata                                    # written once every part is written
    ckpt-3f9c0a1b2d4e-ep000002-ba000000000040.pt     # progress, RNG, hooks: written last

The small ``.pt`` checkpoint (see :mod:`spark_torch_est.checkpoints.checkpoint`) holds the folder's
location and the SHA-256 of every file in it (each rank hashes a share of them), never the
weights; a load checks every file before any state is read, and names one that differs; it is written after every
rank's part and the ``.metadata``, so a checkpoint whose parts are not all written has no
``.pt`` and is never taken as the newest. ``checkpointDir`` must be storage every rank
reaches (a shared filesystem or an object store): DCP reshards on load, so a rank reads
parts that other ranks wrote. The first save checks that every rank sees every part.

Nothing read back is unpickled freely: the ``.metadata`` must match the digest the
checkpoint holds and is read by an unpickler that builds only the exact classes a DCP
metadata file holds (:data:`METADATA_GLOBALS`), then checked to name only files of its
folder; the driver reads it so before any job, each rank before any state is read.
Tensors and other values load with ``torch.load(weights_only=True)``. Every file is read
as a regular file only (see :func:`spark_torch_est.checkpoints.storage.open_regular`).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import logging
import os
import pickle
import posixpath
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import fsspec
import torch
import torch.distributed as dist
from torch import nn

from spark_torch_est.checkpoints.storage import UnsafeFileError, iter_file, local_path, open_regular, read_bytes
from spark_torch_est.core import support
from spark_torch_est.core.ranks import Ranks
from spark_torch_est.errors import IncompatibleCheckpointError, InvalidInputError
from spark_torch_est.train.strategies.base import SavedStates, Strategy

if TYPE_CHECKING:
    from spark_torch_est.checkpoints.checkpoint import Checkpoint
    from spark_torch_est.core.spec import TaskSpec
    from spark_torch_est.train.creators import Creators

__all__ = ["FSDP", "model_to_check", "check_shardable", "shard_targets", "shard_model",
           "full_model_state", "ShardedState", "check_present", "copy_sharded"]

logger = logging.getLogger(__name__)

_METADATA = ".metadata"
#: The most bytes a ``.metadata`` may hold (a model of 10^5 tensors writes some tens of MB).
METADATA_BYTES = 1 << 30


def model_to_check(creators: Creators) -> nn.Module:
    """The model the driver checks before any job under "fsdp": built on the meta device, so
    the driver allocates none of its weights (a model too large for one worker may be too
    large for the driver too). A creator that cannot build there is called as usual."""
    if not isinstance(creators.model, nn.Module):
        try:
            with torch.device("meta"):
                return creators.build_model()
        except Exception:  # e.g. a creator that reads its weights' values
            pass
    return creators.build_model()


def shard_targets(model: nn.Module, class_names: Sequence[str] | None) -> list[nn.Module]:
    """The submodules sharded on their own before the root: those whose class name is in
    ``class_names``, or (None) every direct child holding parameters."""
    if class_names is None:
        return [child for child in model.children() if any(True for _ in child.parameters())]
    wanted = set(class_names)
    return [module for module in model.modules() if module is not model and type(module).__name__ in wanted]


def check_shardable(model: nn.Module, class_names: Sequence[str] | None) -> None:
    """Refuses, on the driver, a model "fsdp" cannot shard.

    Raises:
        InvalidInputError: The model holds no parameters, or a name in ``shardModules`` is
            not the class of any submodule (shows the classes the model has).
    """
    if not any(True for _ in model.parameters()):
        raise InvalidInputError(f'strategy="fsdp" shards the model\'s parameters, but {type(model).__name__} has '
                                'none; use strategy="ddp" or a model with parameters')
    if class_names is None:
        return
    present = {type(module).__name__ for module in model.modules() if module is not model}
    unknown = [name for name in class_names if name not in present]
    if unknown:
        raise InvalidInputError(
            f"shardModules={list(class_names)!r}: no submodule of {type(model).__name__} is a "
            f"{', '.join(map(repr, unknown))}; its submodules' classes are {sorted(present)!r} "
            "(None shards every direct child that holds parameters)"
        )


def shard_model(model: nn.Module, class_names: Sequence[str] | None, device: torch.device) -> nn.Module:
    """Shards ``model`` in place with FSDP2 ``fully_shard``: each target submodule (see
    :func:`shard_targets`), then the root. Collective: every rank calls it.

    The device mesh is named anew for each job: torch caches sharding layouts by mesh, and a
    mesh equal to one of an earlier job in this (reused) Python worker would bring back the
    layout of the rank this worker was then, loading and training another rank's shard.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device.type == "cpu":  # the driver refuses it when it can tell the ranks have no GPU
        support.require(support.FSDP_CPU)
    token = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64, device=device)
    dist.broadcast(token, src=0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=(f"shard_{int(token[0]):x}",))
    for module in shard_targets(model, class_names):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's ``state_dict`` gathered on rank 0, on the CPU (empty on the other
    ranks). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {key: value.detach().cpu() for key, value in state.items() if isinstance(value, torch.Tensor)}


class FSDP(Strategy):
    """Fully sharded: each rank holds its shards of the parameters, gradients and optimizer
    state (FSDP2 ``fully_shard``); checkpoints are sharded, the fit's last one also holds the
    full weights, gathered once.

    Args:
        ranks: This rank and its peers.
        shard_modules: The ``shardModules`` Param (see :func:`shard_targets`).
    """

    name = "fsdp"
    needs = (support.FSDP,)
    needs_on_cpu = (support.FSDP_CPU,)
    sharded = True

    @classmethod
    def model_to_check(cls, creators: Creators) -> nn.Module:
        """Built on the meta device where the creator can (see :func:`model_to_check`)."""
        return model_to_check(creators)

    @classmethod
    def check_model(cls, model: nn.Module, shard_modules: Sequence[str] | None) -> None:
        """See :func:`check_shardable`."""
        check_shardable(model, shard_modules)

    @classmethod
    def for_spec(cls, spec: TaskSpec, ranks: Ranks) -> FSDP:
        return cls(ranks, spec.shard_modules)

    def __init__(self, ranks: Ranks, shard_modules: Sequence[str] | None) -> None:
        super().__init__(ranks)
        self.shard_modules = shard_modules
        self._state: ShardedState | None = None
        self._pointer: dict[str, Any] | None = None  # the newest sharded checkpoint of the run
        self._pointer_step = -1

    def _wrapped(self, model: nn.Module, resumed: bool) -> nn.Module:
        """The model itself, sharded in place."""
        return shard_model(model, self.shard_modules, self.ranks.device)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        super().attach(optimizer)
        self._state = ShardedState(self.model, optimizer, self.ranks.rank, self.ranks.world_size)

    def _sharded(self) -> ShardedState:
        if self._state is None:
            raise RuntimeError("FSDP: attach() the optimizer first")
        return self._state

    def restore(self, resume: Checkpoint) -> None:
        """Loads the model's and optimizer's shards of ``resume`` (DCP reshards them).

        Raises:
            IncompatibleCheckpointError: ``resume`` is not sharded, or its folder is altered.
        """
        self._pointer, self._pointer_step = resume.sharded, resume.progress.global_step
        if resume.sharded is None:
            raise IncompatibleCheckpointError('strategy="fsdp" resumes from a sharded checkpoint; this one '
                                              f"holds the whole state (strategy={resume.strategy!r})")
        self._sharded().load(resume.sharded)

    def save_parts(self, url: str, global_step: int) -> None:
        self._pointer = self._sharded().save(url)
        self._pointer_step = global_step

    def parts_behind(self, global_step: int) -> bool:
        return self._pointer_step != global_step

    def saved_states(self, final: bool) -> SavedStates | None:
        """The full weights when ``final`` (gathered: collective), else none; the optimizer's
        state lies in the parts only."""
        weights = full_model_state(self.model) if final else {}
        if self.ranks.rank != 0:
            return None
        return SavedStates(weights, {}, self._pointer)

    def forward_passes(self, mine: int) -> int:
        """The most batches any rank has: every forward pass gathers the parameters, so every
        rank makes as many. Collective."""
        return int(self.ranks.all_reduce(torch.tensor([mine]), dist.ReduceOp.MAX)[0])


class ShardedState:
    """Saves and loads one rank's part of the model and optimizer state.

    Args:
        model: The sharded model.
        optimizer: Its optimizer.
        rank: This rank.
        world_size: Number of ranks.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int) -> None:
        self.model = model
        self.optimizer = optimizer
        self.rank = rank
        self.world_size = world_size
        self._checked_reach = False

    def save(self, url: str) -> dict[str, Any]:
        """Writes every rank's part into the folder ``url``. Collective.

        Returns:
            ``{"url": url, "digest": SHA-256 of the .metadata, "files": {name: SHA-256}}``
            for every file of the folder (each rank hashes a share of them).

        Raises:
            InvalidInputError: Some rank does not see every part (``checkpointDir`` is not
                shared by the ranks).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, storage_writer=_writer(url))
        if not self._checked_reach:
            self._check_reach(url)
        fs, path = fsspec.core.url_to_fs(url)
        names = sorted(posixpath.basename(p) for p in fs.ls(path, detail=False))
        table = torch.zeros(len(names), 32, dtype=torch.int32)
        for i in range(self.rank, len(names), self.world_size):
            table[i] = torch.tensor(list(bytes.fromhex(_file_sha256(posixpath.join(url, names[i])))))
        table = self._summed(table)  # each row is one rank's, zeros elsewhere
        files = {name: bytes(row.tolist()).hex() for name, row in zip(names, table)}
        return {"url": url, "digest": files[_METADATA], "files": files}

    def _summed(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, on the device the process group works on."""
        if self.world_size == 1:
            return tensor
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else tensor.device
        moved = tensor.to(device)
        dist.all_reduce(moved)
        return moved.cpu()

    def _check_files(self, pointer: dict[str, Any]) -> None:
        """Checks every file of the folder against the digest the checkpoint holds for it,
        each rank a share of them, before any state is read. Collective.

        Raises:
            IncompatibleCheckpointError: Names a file that is missing or differs.
        """
        files: dict[str, str] = pointer.get("files") or {}
        names = sorted(files)
        verdicts = torch.zeros(len(names), dtype=torch.int32)  # 1: differs, 2: missing, 3: not a regular file
        for i in range(self.rank, len(names), self.world_size):
            try:
                verdicts[i] = int(_file_sha256(posixpath.join(pointer["url"], names[i])) != files[names[i]])
            except UnsafeFileError:
                verdicts[i] = 3
            except (OSError, ValueError):
                verdicts[i] = 2
        verdicts = self._summed(verdicts)
        bad = [(name, int(v)) for name, v in zip(names, verdicts) if v]
        if bad:
            name, verdict = bad[0]
            what = {2: "is missing", 3: "is not a regular file in its folder (a FIFO, a device or a symlink out of "
                                        "the folder)"}.get(verdict, "differs from the one the checkpoint was saved "
                                                                    "with (SHA-256)")
            raise IncompatibleCheckpointError(
                f"{name} of the sharded checkpoint {what}: the folder {pointer['url']} was altered or replaced"
                + (f" ({len(bad) - 1} more file(s) too)" if len(bad) > 1 else ""))

    def load(self, pointer: dict[str, Any]) -> None:
        """Loads the model's and optimizer's parts from a folder written by any number of
        ranks (DCP reshards). Collective.

        Raises:
            IncompatibleCheckpointError: The folder is missing or altered, or its state does
                not fit the model.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        metadata = _checked_metadata(pointer["url"], pointer["digest"], pointer.get("files"))
        self._check_files(pointer)
        if not pointer.get("files"):  # an earlier release's checkpoint: no digests, but regular files only
            _check_regular(pointer["url"], metadata)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}  # dcp.load fills it in place
        try:
            dcp.load(state, storage_reader=_reader(pointer["url"], metadata), planner=_planner())
        except (CheckpointException, RuntimeError, ValueError, KeyError, OSError) as error:
            raise IncompatibleCheckpointError(f"cannot load the sharded checkpoint {pointer['url']} into the model: "
                                              f"{_cause(error)[:500]}") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def _check_reach(self, url: str) -> None:
        """Checks, once per fit, that every rank sees the ``.metadata`` and every rank's part."""
        fs, path = fsspec.core.url_to_fs(url)
        names = {posixpath.basename(p) for p in fs.ls(path, detail=False)} if fs.exists(path) else set()
        sees = _METADATA in names and all(f"__{r}_0.distcp" in names for r in range(self.world_size))
        seen = torch.tensor([int(sees)])
        if self.world_size > 1:
            dist.all_reduce(seen, op=dist.ReduceOp.MIN)
        if not bool(seen[0]):
            raise InvalidInputError(
                f"checkpointDir: rank {self.rank} {'does not see' if not sees else 'sees, but another rank misses,'} "
                f"every rank's part of {url}; with strategy=\"fsdp\" checkpointDir must be storage every worker "
                "reaches (a shared filesystem, DBFS, HDFS or an object store), not a local disk"
            )
        self._checked_reach = True


def check_present(pointer: dict[str, Any]) -> None:
    """Checks, on the driver, that a sharded checkpoint's folder still holds its ``.metadata``
    as it was saved and every file the checkpoint lists (by name: the ranks check their
    digests before loading).

    Raises:
        IncompatibleCheckpointError: The folder or one of its files is gone (names it).
    """
    url = pointer["url"]
    fs, path = fsspec.core.url_to_fs(url)
    try:
        present = {posixpath.basename(p) for p in fs.ls(path, detail=False)} if fs.isdir(path) else set()
    except (OSError, ValueError):  # unreadable storage: as good as gone
        present = set()
    missing = sorted({_METADATA, *pointer["files"]} - present)
    if missing:
        raise IncompatibleCheckpointError(
            f"the sharded checkpoint {url} is gone ({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
            "missing): checkpointDir keeps only the newest three checkpoints of each run, and a fitted model's "
            "sharded state lies there until TorchModel.save copies it into the model's folder")
    _checked_metadata(url, pointer["digest"], pointer["files"])


def copy_sharded(pointer: dict[str, Any], url: str) -> dict[str, Any]:
    """Copies a sharded checkpoint's folder to the folder ``url``, checking every file
    against its digest as it is copied (for a checkpoint of an earlier release, which has
    the ``.metadata``'s only, every file there).

    Returns:
        The pointer of the copy: ``pointer`` with ``url``.

    Raises:
        IncompatibleCheckpointError: The folder is gone, or a file differs from the one saved.
        UnsafeFileError: A file of the folder is not a regular file (names it): nothing of
            it was copied.
    """
    check_present(pointer)
    fs, path = fsspec.core.url_to_fs(pointer["url"])
    names = sorted(pointer["files"]) or sorted(posixpath.basename(p) for p in fs.ls(path, detail=False))
    expected = {**pointer["files"], _METADATA: pointer["digest"]}
    copy_fs, copy_path = fsspec.core.url_to_fs(url)
    copy_fs.makedirs(copy_path, exist_ok=True)
    for name in names:
        digest = _file_sha256(posixpath.join(pointer["url"], name), copy_to=posixpath.join(url, name))
        if name in expected and digest != expected[name]:
            raise IncompatibleCheckpointError(f"{name} of the sharded checkpoint {pointer['url']} differs from the "
                                              "one the checkpoint was saved with (SHA-256): the folder was altered")
    return {**pointer, "url": url}


def _writer(url: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    local = local_path(url)
    return FileSystemWriter(local) if local is not None else FsspecWriter(url)


def _checked_metadata(url: str, digest: str, files: dict[str, str] | None = None) -> Any:
    """The folder's ``.metadata`` (DCP's ``Metadata``), if it is the one the checkpoint was
    saved with and holds DCP's metadata only, naming only files of the folder (those in
    ``files``, when the checkpoint lists them).

    Raises:
        IncompatibleCheckpointError: It is missing, unreadable, altered, or holds anything
            else (names the file and what it holds).
    """
    metadata_url = posixpath.join(url, _METADATA)
    try:
        blob = read_bytes(metadata_url, limit=METADATA_BYTES)
    except UnsafeFileError as error:
        raise IncompatibleCheckpointError(f"the sharded checkpoint's {error}; it is not read") from None
    except (OSError, ValueError) as error:
        raise IncompatibleCheckpointError(
            f"the sharded checkpoint {url} is gone or unreadable ({type(error).__name__}: {error}); it may have "
            "been pruned from checkpointDir, or lie on storage this worker cannot reach") from None
    if _sha256(blob) != digest:
        raise IncompatibleCheckpointError(f"{metadata_url} is not the one the checkpoint was saved with (its "
                                          "SHA-256 differs): the folder was altered or replaced")
    return load_metadata(blob, metadata_url, files)


def load_metadata(blob: bytes, where: str, files: dict[str, str] | None = None) -> Any:
    """Unpickles a DCP ``.metadata`` building only :data:`METADATA_GLOBALS`, and checks that
    it is DCP's ``Metadata`` naming only plain file names of its folder (those in ``files``
    when given) for its storage.

    Raises:
        IncompatibleCheckpointError: Names ``where`` and what it holds that DCP's metadata never does.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        loaded = _MetadataUnpickler(io.BytesIO(blob)).load()
    except _Refused as refused:
        raise IncompatibleCheckpointError(
            f"{where} refers to {refused}, which a DCP metadata file never holds: it is not loaded (a crafted file "
            "could run code)") from None
    except Exception as error:  # pickle raises many types for a damaged stream
        raise IncompatibleCheckpointError(f"{where} is not a DCP metadata file ({type(error).__name__}: "
                                          f"{str(error)[:200]})") from None
    if not isinstance(loaded, Metadata):
        raise IncompatibleCheckpointError(f"{where} holds a {type(loaded).__name__}, not DCP's Metadata")
    storage = loaded.storage_data if loaded.storage_data is not None else {}
    for info in storage.values() if isinstance(storage, dict) else [None]:
        name = getattr(info, "relative_path", None)
        if not (isinstance(name, str) and name and "/" not in name and "\\" not in name and name not in (".", "..")
                and (files is None or not files or name in files)):
            raise IncompatibleCheckpointError(
                f"{where} names {name!r} for its data, which is not a file of its folder: it is not loaded")
    return loaded


def _check_regular(url: str, metadata: Any) -> None:
    """Checks that every file ``metadata`` names in the folder ``url`` is a regular file.

    Raises:
        IncompatibleCheckpointError: Names the first one that is not.
    """
    for name in sorted({info.relative_path for info in (metadata.storage_data or {}).values()}):
        try:
            with open_regular(posixpath.join(url, name)):
                pass
        except OSError as error:
            raise IncompatibleCheckpointError(f"{name} of the sharded checkpoint {url} cannot be read: "
                                              f"{error}") from None


def _reader(url: str, metadata: Any) -> Any:
    """A DCP reader of the folder ``url`` that takes its metadata from ``metadata``, read and
    checked by :func:`_checked_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    local = local_path(url)
    base = FileSystemReader if local is not None else FsspecReader

    class CheckedReader(base):  # type: ignore[misc, valid-type]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            loaded = metadata
            if getattr(loaded, "storage_meta", None) is None:
                loaded.storage_meta = StorageMeta()
            loaded.storage_meta.load_id = self.load_id
            return loaded

    return CheckedReader(local if local is not None else url)


def _planner() -> Any:
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnlyPlanner()


_DCP = "torch.distributed.checkpoint"
#: The exact ``(module, name)`` globals a DCP ``.metadata`` holds (torch 2.6 to 2.13: DCP's
#: metadata dataclasses and its memory-format enum, the file storage's ``_StorageInfo``,
#: ``torch.Size``, layouts by name, the path it was saved to), besides dtypes (the
#: ``torch.<dtype>`` attributes, checked to be dtypes). Nothing else is built, so no
#: callable that can run code is reached; a name is never looked up as a dotted path.
METADATA_GLOBALS = frozenset({
    *((f"{_DCP}.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
})


class _Refused(Exception):
    """A global that :data:`METADATA_GLOBALS` does not hold (its ``module.name``)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, building :data:`METADATA_GLOBALS` and dtypes only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(url: str, copy_to: str | None = None) -> str:
    """The SHA-256 of a file, read in chunks (a shard may be large), written on to the file
    ``copy_to`` as it is read when given."""
    digest = hashlib.sha256()
    chunks = iter_file(url)  # a regular file only, no more bytes than it had when opened
    first = next(chunks, b"")  # opened (and checked) before anything is written
    with fsspec.open(copy_to, "wb") if copy_to else nullcontext() as copy:
        for chunk in itertools.chain([first], chunks):
            digest.update(chunk)
            if copy is not None:
                copy.write(chunk)
    return digest.hexdigest()


def _cause(error: BaseException) -> str:
    """``Type: message`` of what failed: for DCP's ``CheckpointException`` (a traceback per
    rank), the first rank's own exception, so that the cause comes first."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        error = getattr(first, "exception", first)
    return f"{type(error).__name__}: {error}"
