"""Benchmarks of ``spark_torch_est`` against plain torch, bare DDP and TorchDistributor.

Run ``python -m benchmarks`` (see ``docs/benchmarks.md``). Each contender is a module
that runs as its own process (``python -m benchmarks.<module>``):

- :mod:`benchmarks.plain`, :mod:`benchmarks.ddp`, :mod:`benchmarks.distributor` and
  :mod:`benchmarks.estimator`: the contenders;
- :mod:`benchmarks.workload`, :mod:`benchmarks.dataset`, :mod:`benchmarks.loop`,
  :mod:`benchmarks.ddp_rank`, :mod:`benchmarks.probes`, :mod:`benchmarks.hooks`: what
  they share, partly run on executors and torchrun workers (see :mod:`benchmarks.remote`);
- :mod:`benchmarks.suite`, :mod:`benchmarks.protocol`, :mod:`benchmarks.machine`,
  :mod:`benchmarks.report`, :mod:`benchmarks.docs`: the driver that runs and reports them.
"""
