"""[driver] Keeps a failed training job out of Spark's own log, since the fit raises it.

A rank that fails raises an exception Spark logs in full, with the JVM's stack, from the
executor (``ERROR Executor: Exception in task``) and from the scheduler (``WARN
TaskSetManager: Lost task``, once for the failed task and once for every task of the
barrier stage it kills): some 40 lines per rank, each carrying the sealed failure report.
The fit raises one :class:`~spark_torch_est.errors.TrainingFailedError` that says all of
it, so two log4j filters (added once to the driver JVM's log configuration, never
replacing anything in it) drop exactly those records:

- records logged on the threads that run this package's training tasks, which carry the
  local property ``mdc.spark_torch_est`` in their MDC (Spark copies ``mdc.*`` local
  properties there, with or without the prefix depending on its version): where the
  executor runs in the driver's JVM (local mode);
- records whose message holds a sealed failure report (the scheduler's lines).

Executors in JVMs of their own (a cluster) keep logging to their own log files.
"""

from __future__ import annotations

import logging
import threading

from pyspark.sql import SparkSession

__all__ = ["TASK_PROPERTY", "TASK_VALUE", "quiet_task_failures"]

logger = logging.getLogger(__name__)

#: The local property that marks the training jobs' tasks (and their MDC).
TASK_PROPERTY = "mdc.spark_torch_est"
TASK_VALUE = "training"
_REPORT = "<<spark_torch_est-failure "  # failure.py's begin marker
_LOCK = threading.Lock()
_QUIETED: set[int] = set()  # identity hashes of the log4j configurations that hold the filters


def quiet_task_failures(spark: SparkSession) -> None:
    """Adds the filters to the driver JVM's current log4j configuration, once; does nothing
    under Spark Connect (no JVM here) or where log4j is not Spark's logging backend."""
    try:
        jvm = spark.sparkContext._jvm
        gateway = spark.sparkContext._gateway
    except Exception:  # Spark Connect: the server's log is not this process's output
        return
    try:
        with _LOCK:
            context = jvm.org.apache.logging.log4j.LogManager.getContext(False)
            configuration = context.getConfiguration()
            key = jvm.java.lang.System.identityHashCode(configuration)
            if key in _QUIETED:
                return
            core = jvm.org.apache.logging.log4j.core
            result = core.Filter.Result
            pairs = gateway.new_array(core.util.KeyValuePair, 2)
            for index, name in enumerate((TASK_PROPERTY, TASK_PROPERTY[len("mdc."):])):
                pairs[index] = core.util.KeyValuePair(name, TASK_VALUE)
            for log_filter in (
                core.filter.ThreadContextMapFilter.createFilter(pairs, "or", result.DENY, result.NEUTRAL),
                core.filter.RegexFilter.createFilter(f"(?s).*{_REPORT}.*", None, False, result.DENY,
                                                     result.NEUTRAL),
            ):
                log_filter.start()
                configuration.addFilter(log_filter)
            context.updateLoggers()
            _QUIETED.add(key)
    except Exception as error:  # another logging backend: Spark's lines stay, the fit is unaffected
        logger.debug("cannot filter Spark's log of failed training tasks: %s", error)
