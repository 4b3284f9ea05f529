"""Benchmarks of ``spark_torch_est`` against plain torch, bare DDP, TorchDistributor,
pyarrow's own read and scikit-learn (see docs/benchmarks.md): ``python -m benchmarks`` (the
side-by-side suite) and the modules ``scale``, ``launch``, ``hook_overhead``, ``tuning``,
``ingest_once``, ``fixed_cost``, ``precision`` and ``sharding``.

They use ``spark_torch_est`` only through its public API, so they measure any checkout of
it: ``BENCH_PACKAGE=/path/to/checkout python -m benchmarks`` imports ``spark_torch_est``
from that checkout, here, in every contender process and in the executors (which run
with the checkout as their working directory, first on their path).
"""

import os
import sys

if os.environ.get("BENCH_PACKAGE"):
    _TREE = os.path.abspath(os.environ["BENCH_PACKAGE"])
    if "spark_torch_est" in sys.modules and not sys.modules["spark_torch_est"].__file__.startswith(_TREE):
        raise ImportError(f"spark_torch_est was imported before benchmarks could take it from {_TREE}")
    sys.path.insert(0, _TREE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_TREE, os.environ.get("PYTHONPATH")]))
    os.chdir(_TREE)  # executors and torchrun workers start here: sys.path[0] is their working directory
