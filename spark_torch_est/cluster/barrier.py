"""[executor] The little of Spark's barrier API that a rank needs, behind an interface tests can fake."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Barrier", "SparkBarrier", "LocalBarrier"]


class Barrier(Protocol):
    """What a training task knows about its barrier stage."""

    rank: int
    world_size: int

    def all_gather(self, message: str) -> list[str]:
        """Every rank's message, in rank order (~1 s in Spark: use sparingly)."""

    def host(self) -> str:
        """This task's executor host."""

    def cpus(self) -> int:
        """CPU cores Spark gave this task."""

    def gpus(self) -> list[str]:
        """GPU addresses Spark gave this task (empty without GPU resources)."""


class SparkBarrier:
    """:class:`Barrier` over ``pyspark.BarrierTaskContext``."""

    def __init__(self) -> None:
        from pyspark import BarrierTaskContext

        self._context = BarrierTaskContext.get()
        self.rank = self._context.partitionId()
        self.world_size = len(self._context.getTaskInfos())

    def all_gather(self, message: str) -> list[str]:
        return list(self._context.allGather(message))

    def host(self) -> str:
        address = self._context.getTaskInfos()[self.rank].address
        return address.rsplit(":", 1)[0]

    def cpus(self) -> int:
        return int(self._context.cpus())

    def gpus(self) -> list[str]:
        resource = self._context.resources().get("gpu")
        return list(resource.addresses) if resource is not None else []


class LocalBarrier:
    """:class:`Barrier` of a lone rank outside Spark: runs the training loop of one rank
    in this process (unit tests, benchmarks, debugging a loop without a cluster)."""

    rank = 0
    world_size = 1

    def all_gather(self, message: str) -> list[str]:
        return [message]

    def host(self) -> str:
        return "127.0.0.1"

    def cpus(self) -> int:
        return 1

    def gpus(self) -> list[str]:
        return []
