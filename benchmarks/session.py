"""The SparkSession of a contender process: ``local[ranks]``, started and stopped for real.

Stopping waits for the JVM to exit, so the next contender never shares the CPUs with a
JVM that is still shutting down.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from pyspark import SparkContext
from pyspark.sql import SparkSession

from benchmarks.workload import Workload

__all__ = ["spark_session"]


@contextmanager
def spark_session(workload: Workload, app: str) -> Iterator[tuple[SparkSession, float]]:
    """Yields a fresh ``local[ranks]`` session and the seconds it took to start."""
    started = time.perf_counter()
    spark = (
        SparkSession.builder.master(f"local[{workload.ranks}]").appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(workload.ranks))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    start_s = time.perf_counter() - started
    try:
        yield spark, start_s
    finally:
        _stop(spark)


def _stop(spark: SparkSession) -> None:
    gateway = SparkContext._gateway
    spark.stop()
    process = getattr(gateway, "proc", None)
    if gateway is not None:
        gateway.shutdown()
    if process is not None:
        process.stdin.close()  # the JVM exits when its stdin closes
        process.wait(timeout=60)
    SparkContext._gateway = SparkContext._jvm = None  # a later session starts a new JVM
