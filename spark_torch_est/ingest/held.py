"""[executor] The rows this Python worker holds in memory between fits: at most one rank's
shard, under the key of what it was read from and converted for.

A Python worker is reused across Spark jobs, so the next fit that gives it the same part
(the same unchanged files, or the same kept rows) and converts it the same way trains on
these rows without reading. Both ways in (:mod:`~spark_torch_est.cluster.worker` for Parquet
parts, :mod:`~spark_torch_est.ingest.kept` for kept rows) go through here, so a worker never
holds two shards.
"""

from __future__ import annotations

from spark_torch_est.ingest.shard import Shard

__all__ = ["held", "hold", "holds", "forget"]

_HELD: dict[str, Shard] = {}  # at most one entry


def held(key: str) -> Shard | None:
    """The shard held under ``key``, or None."""
    return _HELD.get(key)


def holds(key: str) -> bool:
    """Whether the shard under ``key`` is held."""
    return key in _HELD


def hold(key: str, shard: Shard) -> None:
    """Holds ``shard`` under ``key`` instead of what was held."""
    _HELD.clear()
    _HELD[key] = shard


def forget(*prefixes: str) -> None:
    """Lets the held shard go: always without ``prefixes`` (the worker is about to read
    another part), else only when its key starts with one of them."""
    if not prefixes or any(key.startswith(prefixes) for key in _HELD):
        _HELD.clear()
