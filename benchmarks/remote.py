"""Makes the modules whose code runs outside this process travel by value.

Spark executors and torchrun workers do not have ``benchmarks`` on their path, so the
creators, hooks and train functions they unpickle must carry their code. Both copies of
cloudpickle are told: the standalone one (``spark_torch_est`` pickles creators with it)
and pyspark's (``mapInArrow`` and TorchDistributor use it).
"""

from __future__ import annotations

from types import ModuleType

import cloudpickle
from pyspark import cloudpickle as spark_cloudpickle

from benchmarks import dataset, ddp_rank, hooks, loop, probes, recommender, workload

__all__ = ["register_by_value"]

_REMOTE_MODULES = (workload, recommender, probes, loop, dataset, ddp_rank, hooks)


def register_by_value(*extra: ModuleType) -> None:
    """Registers the shared modules, and ``extra`` ones, with both cloudpickles."""
    for module in (*_REMOTE_MODULES, *extra):
        cloudpickle.register_pickle_by_value(module)
        spark_cloudpickle.register_pickle_by_value(module)
