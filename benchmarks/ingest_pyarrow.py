"""Contender: pyarrow reading the ingest workload's files into numpy, in one process, no
Spark: what a ``train_fn`` pays to get the same rows into memory (the reference of the
ingest figures). ``pq.read_table`` (its threads on every core) and one copy of each
column into a writable contiguous array (:func:`benchmarks.dataset.read_numpy`).

Variants: ``""`` reads with ``pre_buffer=False``, the fastest plain ``read_table`` call
on local files here (the reference the targets use); ``"default"`` with
``read_table``'s defaults, as most code calls it.
"""

from __future__ import annotations

import os
import time

import pyarrow.dataset  # noqa: F401 - pq.read_table imports it on its first call: an import, not the read

from benchmarks.dataset import read_numpy
from benchmarks.memory import ingest_prefault_mb, prefault
from benchmarks.probes import peak_rss_mb, reset_peak_rss
from benchmarks.protocol import contender_main
from benchmarks.workload import IngestWorkload

__all__ = ["measure"]


def measure(workload: IngestWorkload, scratch: str, variant: str = "") -> dict:
    """Reads every row once, the first read of the process (its imports done); returns its
    time and memory."""
    prefault_s = prefault(ingest_prefault_mb(workload.rows, workload.features))
    reset_peak_rss()  # the peak from here on is the read's, not the prefault's
    rss_before = peak_rss_mb()
    started = time.perf_counter()
    features, labels = read_numpy(workload.path, pre_buffer=variant == "default")
    read_s = time.perf_counter() - started
    if len(features) != workload.rows:
        raise RuntimeError(f"read {len(features):,} rows of {workload.rows:,}")
    files = [os.path.join(workload.path, name) for name in os.listdir(workload.path)]
    return {"read_s": read_s, "data_mb": (features.nbytes + labels.nbytes) / 2 ** 20,
            "parquet_mb": sum(os.path.getsize(path) for path in files) / 2 ** 20,
            "peak_rss_mb": peak_rss_mb(), "rss_before_mb": rss_before, "prefault_s": prefault_s}


if __name__ == "__main__":
    contender_main(measure)
