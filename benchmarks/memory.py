"""Backs free memory before a timed section, so that allocations cost what they cost on an
ordinary machine.

This machine is a VM whose balloon driver hands free guest pages back to the host a few
seconds after they are freed (free page reporting); touching such a page again costs a
host fault: about 2 s per GB here, measured. A process that allocates a large table
after the machine sat idle for 20 s read 1M rows in 1.5 s, and in 0.13 s right after
another process had touched and freed the same amount. So the ingest contenders touch
and free :func:`prefault` memory right before each timed call: the timed allocations
then find pages the host backs, whichever process makes them.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["prefault", "ingest_prefault_mb"]

_PAGE = 4096


def prefault(megabytes: float) -> float:
    """Touches ``megabytes`` of fresh memory page by page, frees it; returns the seconds it took."""
    started = time.perf_counter()
    block = np.empty(int(megabytes * 2 ** 20), dtype=np.uint8)
    block[::_PAGE] = 1
    del block
    return time.perf_counter() - started


def ingest_prefault_mb(rows: int, features: int) -> float:
    """What to back before an ingest of ``rows`` x (``features`` + label) float32: three
    times the data (a table, its copy and decode buffers) and 512 MB."""
    return 3 * rows * (features + 1) * 4 / 2 ** 20 + 512
