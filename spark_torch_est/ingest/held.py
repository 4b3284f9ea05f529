"""[executor] The held rows: what this Python worker keeps in memory between fits, at most
one rank's :class:`~spark_torch_est.ingest.tables.IngestedRows`, under the key of what they
were read from and converted for. They stay until the worker reads another part, a key they
fall under is dropped (its kept rows' DataFrame was released), or the Python worker exits.

A Python worker is reused across Spark jobs, so the next fit that gives it the same part
(the same unchanged files, or the same kept rows) and converts it the same way trains on
these rows without reading. Both ways in (:mod:`~spark_torch_est.cluster.worker` for Parquet
parts, :mod:`~spark_torch_est.ingest.kept` for kept rows) go through here, so a worker never
holds two ranks' rows.
"""

from __future__ import annotations

from spark_torch_est.ingest.tables import IngestedRows

__all__ = ["held", "hold", "holds", "forget"]

_HELD: dict[str, IngestedRows] = {}  # at most one entry


def held(key: str) -> IngestedRows | None:
    """The rows held under ``key``, or None."""
    return _HELD.get(key)


def holds(key: str) -> bool:
    """Whether rows are held under ``key``."""
    return key in _HELD


def hold(key: str, ingested: IngestedRows) -> None:
    """Holds ``ingested`` under ``key`` instead of the rows held so far."""
    _HELD.clear()
    _HELD[key] = ingested


def forget(*prefixes: str) -> None:
    """Lets the held rows go: always without ``prefixes`` (the worker is about to read
    another part), else only when its key starts with one of them."""
    if not prefixes or any(key.startswith(prefixes) for key in _HELD):
        _HELD.clear()
