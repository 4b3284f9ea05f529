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

from pyspark.sql import SparkSession

from spark_torch_est.core.jvm import deny_log_records

__all__ = ["TASK_PROPERTY", "TASK_VALUE", "quiet_task_failures"]

#: The local property that marks the training jobs' tasks (and their MDC).
TASK_PROPERTY = "mdc.spark_torch_est"
TASK_VALUE = "training"
_REPORT = "<<spark_torch_est-failure "  # failure.py's begin marker


def quiet_task_failures(spark: SparkSession) -> None:
    """Adds the filters to the driver JVM's current log4j configuration, once; does nothing
    under Spark Connect (no JVM here) or where log4j is not Spark's logging backend."""
    deny_log_records(spark, {TASK_PROPERTY: TASK_VALUE, TASK_PROPERTY[len("mdc."):]: TASK_VALUE},
                     f"(?s).*{_REPORT}.*")
