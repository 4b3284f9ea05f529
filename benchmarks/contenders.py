"""``python -m benchmarks.contenders NAME WORKLOAD_JSON [FITS]``: the contender ``NAME`` (the
function of that name) in a fresh process, printing its figures as one ``BENCH_RESULT {json}``
line. Every ``TorchEstimator`` fit carries a :class:`~benchmarks.common.Probe` (public hook API).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import common
from benchmarks.common import RESULT, Probe, Workload

#: The ingest fits, in order: (name, on ``df.cache()``?, directRead, how the ranks must have
#: read the rows, touch the files first so that the ranks read them again). Cached fits
#: come last: once the table's plan is cached, every read of it goes through the cache.
INGEST_FITS = (
    ("cold", False, True, "files", False),
    ("warm", False, True, "files", True),
    ("spark", False, False, "spark", True),
    ("cache_first", True, True, "spark", True),
    ("cache_second", True, True, "spark", False),
)


def plain(workload: Workload, scratch: str) -> dict:
    """Plain torch: one process with every core, the global batch of the DDP ranks."""
    torch.set_num_threads(os.cpu_count() or 1)
    called = time.time()
    inputs, labels = common.read_rank(workload, 0, 1)
    model, optimizer = workload.build()
    clock = common.plain_train(model, optimizer, inputs, labels, workload.loss_fn(), epochs=workload.epochs,
                               batch_size=workload.batch_size * workload.ranks, seed=workload.seed)
    return {"wall_s": time.time() - called, **clock.figures(called), "loss": common.final_loss(model, workload)}


def ddp_rank(workload: Workload, rank: int, world_size: int, report: str) -> None:
    """One DDP rank of the peers between ``init_process_group`` and the teardown; rank 0
    writes its step stamps and final loss to ``report``."""
    model, optimizer = workload.build()
    inputs, labels = common.read_rank(workload, rank, world_size)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    clock = common.plain_train(wrapped, optimizer, inputs, labels, workload.loss_fn(), epochs=workload.epochs,
                               batch_size=workload.batch_size, seed=workload.seed, rank=rank, world_size=world_size)
    del wrapped
    if rank == 0:
        Path(report).write_text(json.dumps(vars(clock)))
        torch.save(model.state_dict(), report + ".pt")
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def _read_report(workload: Workload, report: str, called: float) -> dict:
    """The wall time since ``called``, rank 0's step figures and its model's final loss."""
    wall, clock, (model, _) = time.time() - called, common.Clock(), workload.build()
    vars(clock).update(json.loads(Path(report).read_text()))
    model.load_state_dict(torch.load(report + ".pt"))
    return {"wall_s": wall, **clock.figures(called), "loss": common.final_loss(model, workload)}


def _spawned(rank: int, workload: Workload, port: int, report: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=workload.ranks,
                            timeout=timedelta(seconds=120))
    ddp_rank(workload, rank, workload.ranks, report)


def ddp(workload: Workload, scratch: str) -> dict:
    """Bare DDP: ``torch.multiprocessing.spawn`` of the ranks, gloo, 1 thread each."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    report, called = os.path.join(scratch, "ddp.json"), time.time()
    torch.multiprocessing.spawn(_spawned, args=(workload, port, report), nprocs=workload.ranks, join=True)
    return _read_report(workload, report, called)


def train_fn(workload_json: str, report: str) -> None:
    """TorchDistributor's train_fn: the same DDP rank as bare DDP, under torchrun."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ddp_rank(Workload(**json.loads(workload_json)), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), report)


def _distributor(workload: Workload, scratch: str, local_mode: bool) -> dict:
    """``TorchDistributor`` running bare DDP's rank as its ``train_fn``: a cold and a warm ``run()``."""
    from pyspark.ml.torch.distributor import TorchDistributor

    common.register_by_value()  # this module runs as __main__: pickled by value already
    result = {}
    with common.spark_session(workload.ranks, "bench-torchdistributor"):
        for when in ("cold", "warm"):
            report, called = os.path.join(scratch, f"td-{when}.json"), time.time()
            distributor = TorchDistributor(num_processes=workload.ranks, local_mode=local_mode, use_gpu=False)
            distributor.run(train_fn, json.dumps(dataclasses.asdict(workload)), report)
            result.update({f"{when}_{key}": value for key, value in _read_report(workload, report, called).items()})
    return result


td_local = functools.partial(_distributor, local_mode=True)
td_barrier = functools.partial(_distributor, local_mode=False)


def estimator(workload: Workload, hooks: list | dict, **params):
    """The workload's ``TorchEstimator``, as a user writes it."""
    from spark_torch_est import TorchEstimator

    columns = {"inputCols": workload.input_cols} if workload.kind == "rec" else {"featuresCol": "features"}
    params = {"maxEpochs": workload.epochs, "numWorkers": workload.ranks, "seed": workload.seed, **params}
    return TorchEstimator(model=common.make_model, optimizer=common.make_optimizer, loss=workload.loss_fn(),
                          config=workload.config, hooks=hooks, labelCol=workload.label_col,
                          batchSize=workload.batch_size, showProgress=False, **columns, **params)


def timed_fit(workload: Workload, df, probe: Probe, duration: str | None = None, hooks: tuple = (),
              **params) -> tuple[dict, object]:
    """One fit of a new estimator with ``hooks`` and ``probe``; its figures (``wall_s``, rank
    0's ``first_step_s`` and loop, the largest rank's ``peak_rss_mb``, ``read``: how the ranks
    got the rows) and its model."""
    est = estimator(workload, [*hooks, probe], **params)
    called = time.time()
    model = est.fit(df, duration=duration)
    figures = {"wall_s": time.time() - called, **probe.read(workload.ranks, called)}
    return {**figures, "read": _read(est)}, model


def _read(est) -> str:
    """How the ranks of ``est``'s last fit got the rows: "spark", "files", or "" where its
    checkpoint does not say (older checkouts)."""
    source = getattr(est.checkpoint, "data_source", None)  # "spark...", or the digest of the files the ranks read
    return "" if source is None else "spark" if source.startswith("spark") else "files"


def touch(path: str) -> None:
    """New modification times: the ranks read the files again instead of reusing what their
    Python workers kept from an earlier fit (the peers read them every time)."""
    for file in Path(path).rglob("*"):
        os.utime(file)


def te(workload: Workload, scratch: str) -> dict:
    """``TorchEstimator(...).fit(spark.read.parquet(path))``: a cold fit (the recommender's: 50
    steps, a warm-up), then a warm one of a new estimator."""
    common.register_by_value()
    with common.spark_session(workload.ranks, "bench-torchestimator") as spark:
        df = spark.read.parquet(workload.path)
        cold, _ = timed_fit(workload, df, Probe(scratch, "cold"), duration="50ba" if workload.kind == "rec" else None)
        touch(workload.path)
        warm, model = timed_fit(workload, df, Probe(scratch, "warm"))
    return {**{f"cold_{k}": v for k, v in cold.items() if k != "read"},
            **{f"warm_{k}": v for k, v in warm.items() if k != "read"},
            "loss": common.final_loss(model.torch_model(), workload)}


def pyarrow(workload: Workload, scratch: str) -> dict:
    """``pq.read_table`` of the ingest table into numpy: the first read of a process."""
    import pyarrow.dataset  # noqa: F401  (read_table imports it on its first call: an import, not the read)

    common.prefault(workload)
    common.reset_peak_rss()
    started = time.perf_counter()
    features, labels = common.read_columns(workload.path, ["features", "label"])
    read_s = time.perf_counter() - started
    return {"read_s": read_s, "peak_rss_mb": common.peak_rss_mb(),
            "parquet_mb": sum(f.stat().st_size for f in Path(workload.path).iterdir()) / 2 ** 20}


def _rows_per_s(frame, rows: int) -> float:
    started = time.perf_counter()
    frame.write.format("noop").mode("overwrite").save()
    return rows / (time.perf_counter() - started)


def ingest(workload: Workload, scratch: str, fits: str = "", daemon: str = "") -> dict:
    """The fits of :data:`INGEST_FITS` (those named in ``fits``), then ``transform``; with
    ``daemon``, in a session whose Python workers that module forks (``spark.python.daemon.module``)."""
    common.register_by_value()
    chosen = [fit for fit in INGEST_FITS if not fits or fit[0] in fits.split(",")]
    result, model = {}, None
    conf = {"spark.python.daemon.module": daemon} if daemon else {}
    with common.spark_session(workload.ranks, "bench-torchestimator-ingest", **conf) as spark:
        df = spark.read.parquet(workload.path)
        result["partitions"] = df.rdd.getNumPartitions()
        for name, cached, direct, expect, touch_first in chosen:
            if touch_first:
                touch(workload.path)
            common.prefault(workload)
            frame = df.cache() if cached else df
            figures, fitted = timed_fit(workload, frame, Probe(scratch, name), f"{workload.steps}ba", directRead=direct)
            if figures.pop("read") not in (expect, ""):
                raise RuntimeError(f"the {name} fit did not read its rows through {expect}")
            result.update({f"{name}_{k}": v for k, v in figures.items() if k in ("first_step_s", "peak_rss_mb")})
            model = model or fitted
        df.unpersist(blocking=True)
        if not fits:  # the first call loads the model into the Python workers, the others find it there
            scorers = {"files": model, "spark": model.copy({model.directRead: False})}
            for name in ("files", "spark", "files"):
                result[f"transform_{name}_rows_per_s"] = _rows_per_s(scorers[name].transform(df), workload.rows)
    if not fits:  # after the JVM has exited: the plain forward has every core
        result["transform_plain_rows_per_s"] = _plain_forward(model.torch_model(), workload)
    return result


def through_spark(workload: Workload, scratch: str) -> dict:
    """The first fit of a cached, computed DataFrame (``label * 2``, cached and counted) against
    Spark's own scan of it into Arrow batches in as many Python tasks (:func:`_scan_s`), in one
    ``local[ranks]`` session (4 GB: the cache stays in memory) whose Python workers have started
    and imported ``spark_torch_est`` (a fit of 1,000 of the rows). The scan runs before and after
    the fit; ``scan_s`` is the faster, so the ratio errs against the fit."""
    from pyspark.sql import functions as F

    common.register_by_value()
    with common.spark_session(workload.ranks, "bench-through-spark", **{"spark.driver.memory": "4g"}) as spark:
        df = spark.read.parquet(workload.path).withColumn("label", F.col("label") * 2).cache()
        df.count()
        estimator(workload, [], keepIngestedMB=0).fit(df.limit(1000), duration="1ba")
        _scan_s(df.limit(1000), workload.ranks)
        common.prefault(workload)
        before = _scan_s(df, workload.ranks)
        common.prefault(workload)
        first, _ = timed_fit(workload, df, Probe(scratch, "first"), f"{workload.steps}ba")
        after = _scan_s(df, workload.ranks)
        df.unpersist(blocking=True)
    if first["read"] not in ("spark", ""):
        raise RuntimeError("the first fit of the cached DataFrame did not read its rows through Spark")
    return {"first_step_s": first["first_step_s"], "peak_rss_mb": first["peak_rss_mb"], "scan_s": min(before, after),
            "scan_before_s": before, "scan_after_s": after}


def _scan_s(df, tasks: int) -> float:
    """Seconds Spark takes to hand every row of ``df`` to ``tasks`` Python tasks as Arrow batches:
    ``coalesce(tasks)`` (no shuffle), ``mapInArrow`` reading each batch and returning none, into the
    ``noop`` sink."""
    started = time.perf_counter()
    df.coalesce(tasks).mapInArrow(_drain, df.schema).write.format("noop").mode("overwrite").save()
    return time.perf_counter() - started


def _drain(batches):
    for _ in batches:  # each batch is read from Spark's stream into the worker
        pass
    yield from ()


#: The runs of :func:`layout`, by plan: whether the ranks read the files (``directRead``), and
#: each run's fits by their ``numWorkers``.
LAYOUTS = {"spark": (False, ((2,), (3,))), "resize": (True, ((2, 3), (3, 2)))}


def layout(workload: Workload, scratch: str, plan: str) -> dict:
    """How far a rank's peak RSS rises above its RSS before the call, while its fit lays out its
    rows, in shares of the table above one (:func:`_layout_fit`), for the runs of ``plan`` in
    :data:`LAYOUTS`: ``spark``, a fit through Spark on 2 ranks, then one on 3 (a new run); ``resize``,
    a run on the files read directly over 2 ranks continued on 3, then one over 3 continued on 2.
    Before each fit every Python worker drops the rows it holds: a fit of 1,000 rows on every slot."""
    direct, runs = LAYOUTS[plan]
    slots = max(max(run) for run in runs)
    common.register_by_value()
    result = {}
    with common.spark_session(slots, "bench-layout") as spark:
        df = spark.read.parquet(workload.path)
        clearing = estimator(dataclasses.replace(workload, ranks=slots), [], keepIngestedMB=0)
        for run in runs:
            probe = Probe(scratch, "layout")
            est = estimator(workload, [probe], directRead=direct)
            for ranks, before in zip(run, (None, *run)):
                clearing.copy().fit(df.limit(1000), duration="1ba")
                name = f"{'files' if direct else 'spark'}_{ranks}" + (f"_after_{before}" if before else "")
                figures = _layout_fit(est.setNumWorkers(ranks), df, probe, workload.table_mb / ranks)
                if figures.pop("read") not in ("files" if direct else "spark", ""):
                    raise RuntimeError(f"the {name} fit did not read its rows as planned (directRead={direct})")
                result.update({f"{name}_{key}": value for key, value in figures.items()})
    return result


def _layout_fit(est, df, probe: Probe, share_mb: float) -> dict:
    """One more step of ``est``'s run: the largest rise over the ranks from a rank's RSS before
    the call (its worker's, read by the driver, which resets the worker's peak) to its peak RSS at
    its first step (read by the rank), in shares (``share_mb``) above one (``above_share``); rank
    0's call to its first step; how it read the rows."""
    before = common.reset_peaks_below()
    called = time.time()
    est.fit(df, duration="1ba")
    reports = probe.reports(est.getNumWorkers())
    if any(r["pid"] not in before for r in reports):
        raise RuntimeError("a rank ran in a Python worker started during the fit: its RSS before the rows is unknown")
    rise = max(r["first_step_peak_mb"] - before[r["pid"]] for r in reports)
    return {"above_share": rise / share_mb - 1, "rise_mb": rise, "before_mb": max(before[r["pid"]] for r in reports),
            "first_step_s": reports[0]["fit_first"] - called, "read": _read(est)}


def _plain_forward(model: torch.nn.Module, workload: Workload) -> float:
    torch.set_num_threads(os.cpu_count() or 1)
    (features,) = common.read_columns(workload.path, ["features"])
    rows, batch = torch.from_numpy(features), 4096
    with torch.inference_mode():
        started = time.perf_counter()
        torch.cat([model(rows[start:start + batch]) for start in range(0, len(rows), batch)]).numpy()
    return len(rows) / (time.perf_counter() - started)


if __name__ == "__main__":
    name, workload, *extra = sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        figures = globals()[name](Workload(**json.loads(workload)), scratch, *extra)
    print(RESULT + json.dumps(figures), flush=True)
