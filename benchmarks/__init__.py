"""Benchmarks of ``spark_torch_est`` against plain torch, bare DDP, TorchDistributor and
pyarrow's own read.

Run ``python -m benchmarks`` and ``python -m benchmarks.scale`` (see
``docs/benchmarks.md``). Each contender is a module that runs as its own process
(``python -m benchmarks.<module>``):

- :mod:`benchmarks.plain`, :mod:`benchmarks.ddp`, :mod:`benchmarks.distributor`,
  :mod:`benchmarks.estimator`, :mod:`benchmarks.rec_estimator`,
  :mod:`benchmarks.ingest_pyarrow` and :mod:`benchmarks.ingest_estimator`: the contenders;
- :mod:`benchmarks.workload`, :mod:`benchmarks.recommender`, :mod:`benchmarks.dataset`,
  :mod:`benchmarks.loop`, :mod:`benchmarks.ddp_rank`, :mod:`benchmarks.probes`,
  :mod:`benchmarks.hooks`: what they share, partly run on executors and torchrun workers
  (see :mod:`benchmarks.remote`); :mod:`benchmarks.fits`, :mod:`benchmarks.session`,
  :mod:`benchmarks.listener`, :mod:`benchmarks.forward`: what this project's contenders share;
- :mod:`benchmarks.suite`, :mod:`benchmarks.protocol`, :mod:`benchmarks.machine`,
  :mod:`benchmarks.tables`, :mod:`benchmarks.report`, :mod:`benchmarks.report_typed`,
  :mod:`benchmarks.report_ingest`, :mod:`benchmarks.docs`: the driver that runs and
  reports them; :mod:`benchmarks.scale`: the growth table's driver.
"""
