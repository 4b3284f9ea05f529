"""[driver] MLWritable/MLReadable for the estimator and the model: JSON Params through
pyspark's DefaultParams metadata (so Pipeline and PipelineModel can save and load them),
with the torch parts beside it in ``<path>/torch/``."""

from __future__ import annotations

from typing import Callable, Protocol

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter

from spark_torch_est.storage import read_bytes, write_atomic

__all__ = ["Persistable", "TorchPersistence", "TorchWriter", "TorchReader"]


class Persistable(Protocol):
    """What a savable stage provides besides its Params."""

    def _persisted_files(self) -> dict[str, bytes]:
        """File name -> content, written under ``<path>/torch/``."""

    @classmethod
    def _from_files(cls, read: Callable[[str], bytes | None]) -> Persistable:
        """Rebuilds the stage (without Params) from its files; ``read`` returns None for
        a file that was not saved."""


class TorchWriter(MLWriter):
    """Writes a :class:`Persistable` stage."""

    def __init__(self, instance: Persistable) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession.sparkContext)
        for name, blob in self.instance._persisted_files().items():
            write_atomic(f"{path}/torch/{name}", blob)


class TorchReader(MLReader):
    """Reads what :class:`TorchWriter` wrote."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Persistable:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession.sparkContext)

        def read(name: str) -> bytes | None:
            try:
                return read_bytes(f"{path}/torch/{name}")
            except FileNotFoundError:
                return None

        instance = self.cls._from_files(read)
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        return instance


class TorchPersistence(MLReadable, MLWritable):
    """Mixin: ``save``/``load``/``write``/``read`` for a stage that implements
    ``_persisted_files`` and ``_from_files`` (see :class:`Persistable`)."""

    def write(self) -> MLWriter:
        """Saves Params as JSON and the stage's torch files under ``<path>/torch/``."""
        return TorchWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        """Reads what :meth:`write` saved."""
        return TorchReader(cls)
