"""[driver] MLWritable/MLReadable for the estimator and the model: JSON Params through
pyspark's DefaultParams metadata (so Pipeline and PipelineModel can save and load them),
with the torch parts beside it in ``<path>/torch/``.

Spark writes the metadata (on the cluster, through the session, which also works from a
Spark Connect client); this process writes and reads the torch files with fsspec. Under
Spark Connect the two only meet when the client and the cluster share the filesystem at
that path (``hdfs://``, ``s3://``, a shared mount), which saving checks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pyspark.ml.param import Params
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql.utils import is_remote

from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.checkpoints.storage import UnsafeFileError, exists, read_bytes, remove, write_atomic
from spark_torch_est.core.support import installed
from spark_torch_est.errors import IncompatibleCheckpointError, InvalidInputError, SparkTorchError
from spark_torch_est.params.base import declare_params
from spark_torch_est.train.strategies.fsdp import copy_sharded

__all__ = ["TorchPersistence", "TorchWriter", "TorchReader", "saved_checkpoint", "loaded_checkpoint", "read_required"]

logger = logging.getLogger(__name__)

_REQUIRED = "creators.pkl"
#: Where a saved stage keeps the copy of its checkpoint's sharded state, under ``<path>/torch/``.
_SHARDED = "sharded"


def saved_checkpoint(checkpoint: Checkpoint, folder: str) -> bytes:
    """The bytes of ``checkpoint`` as a stage saved in ``folder`` keeps it, with what
    continuing it needs: a sharded state is copied (its files checked against their
    digests) to ``folder/sharded``, and the saved checkpoint points there. A sharded state
    that is gone or altered is not copied: the stage is saved for inference (a warning says
    so), and a fit from it is refused (before any job where the folder is gone). A file of
    the folder that is not a regular file (a FIFO, a device, a symlink out of the folder)
    fails the save at once, naming it.

    Raises:
        IncompatibleCheckpointError: A file of the sharded state is not a regular file.
    """
    if checkpoint.sharded is None:
        return checkpoint.to_bytes()
    copy = f"{folder}/{_SHARDED}"
    try:
        return checkpoint.with_sharded_url(copy_sharded(checkpoint.sharded, copy)["url"]).to_bytes()
    except UnsafeFileError as error:  # a FIFO or a device would block the copy or fill the disk
        remove(copy)
        raise IncompatibleCheckpointError(f"cannot save the sharded state of {checkpoint!r}: {error}") from None
    except IncompatibleCheckpointError as error:
        remove(copy)
        logger.warning("saved without its sharded optimizer state, so it transforms but cannot be continued: %s",
                       error)
        return checkpoint.to_bytes()


def loaded_checkpoint(blob: bytes, folder: str) -> Checkpoint:
    """A checkpoint :func:`saved_checkpoint` wrote, its sharded state found in ``folder``
    wherever the saved stage now is; one saved without the copy (by an earlier release)
    keeps its pointer."""
    checkpoint = Checkpoint.from_bytes(blob)
    copy = f"{folder}/{_SHARDED}"
    if checkpoint.sharded is not None and exists(f"{copy}/.metadata"):
        return checkpoint.with_sharded_url(copy)
    return checkpoint


def read_required(read: Callable[[str], bytes | None], name: str, folder: str) -> bytes:
    """``read(name)`` (see :meth:`TorchPersistence._from_files`) for a file the stage always saves.

    Raises:
        InvalidInputError: The file is not in ``folder``.
    """
    blob = read(name)
    if blob is None:
        raise InvalidInputError(f"{folder}/{name} is missing: the saved stage is incomplete")
    return blob


def _session_arg(spark: Any) -> Any:
    """What pyspark.ml's metadata reader and writer take: the session from pyspark 4.0
    (also under Spark Connect), its SparkContext before."""
    return spark if installed("pyspark") >= (4, 0) else spark.sparkContext


class TorchWriter(MLWriter):
    """Writes a :class:`TorchPersistence` stage."""

    def __init__(self, instance: TorchPersistence) -> None:
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        if is_remote():  # pyspark's own handler needs a JVM in this process
            from pyspark.ml.connect.readwrite import RemoteMLWriter

            RemoteMLWriter.handleOverwrite(path, True)
        else:
            super()._handleOverwrite(path)

    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(_as_params(self.instance), path, _session_arg(self.sparkSession))
        if is_remote() and not exists(f"{path}/metadata"):
            raise SparkTorchError(
                f"cannot save to {path!r} from this Spark Connect client: the cluster wrote the Params to "
                f"{path}/metadata, but this process, which writes the torch files, does not see them there. "
                "Save to storage that the client and the cluster share (hdfs://, s3://, a shared mount), "
                "or save from a classic session"
            )
        for name, blob in self.instance._persisted_files(f"{path}/torch").items():
            write_atomic(f"{path}/torch/{name}", blob)


class TorchReader(MLReader):
    """Reads what :class:`TorchWriter` wrote."""

    def __init__(self, cls: type[TorchPersistence]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> TorchPersistence:
        metadata = DefaultParamsReader.loadMetadata(path, _session_arg(self.sparkSession))

        def read(name: str) -> bytes | None:
            try:
                return read_bytes(f"{path}/torch/{name}")
            except FileNotFoundError:
                return None
            except UnsafeFileError as error:
                raise InvalidInputError(f"cannot load {path!r}: {error}") from None

        if not exists(f"{path}/torch/{_REQUIRED}"):
            shared = (" (from a Spark Connect client, the client and the cluster must share the filesystem "
                      "at that path)") if is_remote() else ""
            raise InvalidInputError(f"{path!r} has Params but no torch/{_REQUIRED}: it was not saved by "
                                    f"{self.cls.__name__}.save, or this process cannot read it{shared}")
        instance = self.cls._from_files(read, f"{path}/torch")
        params = _as_params(instance)
        declare_params(params, [*metadata["paramMap"], *metadata.get("defaultParamMap", {})])
        params._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        return instance


class TorchPersistence(MLReadable, MLWritable):
    """Mixin for a pyspark.ml stage (a Params class): ``save``/``load``/``write``/``read``,
    the Params as pyspark.ml saves them and the torch files the stage gives in
    :meth:`_persisted_files` and is rebuilt from in :meth:`_from_files`."""

    def _persisted_files(self, folder: str) -> dict[str, bytes]:
        """File name -> content, written under ``folder`` (``<path>/torch/``), where
        the stage may also copy what its checkpoint needs (see :func:`saved_checkpoint`)."""
        raise NotImplementedError

    @classmethod
    def _from_files(cls, read: Callable[[str], bytes | None], folder: str) -> TorchPersistence:
        """Rebuilds the stage (without Params) from its files in ``folder``; ``read``
        returns None for a file that was not saved."""
        raise NotImplementedError

    def write(self) -> MLWriter:
        """Saves Params as JSON and the stage's torch files under ``<path>/torch/``."""
        return TorchWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        """Reads what :meth:`write` saved."""
        return TorchReader(cls)


def _as_params(stage: TorchPersistence) -> Params:
    """The stage as the pyspark.ml Params it is (the mixin goes on Params classes only)."""
    if not isinstance(stage, Params):
        raise TypeError(f"{type(stage).__name__} mixes in TorchPersistence but is not a pyspark.ml Params")
    return stage
