"""[executor] Barrier-task entry point: ingest, rendezvous, process group, loop, teardown, result.

Runs in the Spark task's own Python worker (one rank per task). Imports nothing from the
driver side. The teardown order matters in a reused Python worker: every object that
holds the process group (the DDP Reducer above all) must be gone before
``destroy_process_group``, or the next fit in the session hangs (docs/reliability.md).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import cloudpickle
import fsspec
import pyarrow as pa
import torch
import torch.distributed as dist

from spark_torch_est.checkpoints.checkpoint import iter_chunks
from spark_torch_est.cluster.barrier import Barrier, SparkBarrier
from spark_torch_est.cluster.channel import EXECUTOR_ONLY, ChannelClient, LogForwarder, ProgressReporter
from spark_torch_est.cluster.failure import Failure, RankFailure, SparkInputLost, describe
from spark_torch_est.cluster.rendezvous import authenticate_peers, connect_store
from spark_torch_est.core.arrow import binary_array, from_numpy
from spark_torch_est.core.file_identity import file_stamp
from spark_torch_est.core.progress import Progress
from spark_torch_est.core.protocol import DELIVERED, pack_runs
from spark_torch_est.core.spec import JOB_FIELDS, Launch, TaskSpec
from spark_torch_est.core.worker_gc import freeze_older
from spark_torch_est.ingest import held
from spark_torch_est.ingest.kept import keep_while_reading, take_kept
from spark_torch_est.ingest.parquet_read import read_part
from spark_torch_est.ingest.staged import staged_batches, staged_files
from spark_torch_est.ingest.tables import IngestedRows, read_rows
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.devices import cpu_despite_gpus, task_device

__all__ = ["train_task", "run_rank"]

logger = logging.getLogger(__name__)

_ARROW_RESULT = pa.schema([("seq", pa.int64()), ("data", pa.binary())])
#: The last part of a table this worker read itself, by :func:`_part_key` (see :func:`_ingest`).
#: DDP models something still referenced at teardown: never freed (see _teardown).
_KEPT_ALIVE: list[object] = []
#: How long a rank lets go of the GIL before destroying its process group (see :func:`_teardown`).
_GIL_RELEASE_S = 0.05


def train_task(spec: TaskSpec | Any, launch: Launch) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Returns the ``mapInArrow`` function for one job (a top-level function, no closure
    over driver objects). ``spec`` may come as a Spark broadcast of it (see
    ``launcher._shipped``): the function itself then stays small."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        freeze_older()
        barrier = SparkBarrier()
        torch.set_num_threads(max(1, barrier.cpus()))
        result = run_rank(spec if isinstance(spec, TaskSpec) else spec.value, launch, batches, barrier)
        if isinstance(result, str):
            yield _result_row(DELIVERED, result.encode())
        elif result is not None:
            for seq, chunk in enumerate(iter_chunks(result)):
                yield _result_row(seq, bytes(chunk))

    return task


def _result_row(seq: int, data: bytes) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([from_numpy([seq]), binary_array([data])],
                                      schema=_ARROW_RESULT)


def run_rank(spec: TaskSpec, launch: Launch, batches: Iterator[pa.RecordBatch], barrier: Barrier) -> bytes | str | None:
    """Runs one rank of the job. Rank 0 returns the checkpoint: its SHA-256 (hex) when the
    driver acknowledged it over the channel, else its bytes, for result rows. Other
    ranks return None.

    Raises:
        RankFailure: Anything failed; carries a sealed :class:`Failure` for the driver.
    """
    rank = barrier.rank
    stage = "rendezvous"
    started = time.perf_counter()
    store: dist.Store | None = None
    failure: Failure | None
    reading: _Beside | None = None
    arrived: list[float] = []  # when the job's input brought its first rows
    batches = _from_spark(batches)
    try:
        device = _device(spec, barrier)  # before any thread starts beside this one (see _Beside)
        stage = "ingest"
        if spec.kept is not None and spec.kept.mode == "read":  # the ranks tell which parts they kept
            store = connect_store(launch, barrier, spec.timeout_s)
            rank, ingested = take_kept(spec, batches, store, rank)
        elif spec.source is not None:  # the files are read beside the rendezvous, which needs no rows
            for _ in batches:  # the job's input: one row per rank, nothing to train on
                pass
            reading = _Beside(lambda: _ingest(spec, iter(()), rank))
        else:  # before the rendezvous: a rank meets the others once its rows are in (see docs/ingest.md)
            files: list[str] = []
            if spec.staged is not None:  # its logical partition, from the staged files
                for _ in batches:  # the job's input: one row per rank, nothing to train on
                    pass
                files = [path for path, _ in staged_files(spec.staged, rank, spec.world_size)]
                batches = staged_batches(spec.staged, rank, spec.world_size)
            ingested = _ingest(spec, _noting_first(batches, arrived), rank, files)
        ingest_done = time.perf_counter()  # the rows are in, or being read beside
        stage = "rendezvous"
        if store is None:
            store = connect_store(launch, barrier, spec.timeout_s)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
            world_size=spec.world_size, timeout=timedelta(seconds=spec.timeout_s),
        )
        authenticate_peers(launch.secret, rank, spec.world_size, device)
        phases = {"rendezvous": time.perf_counter() - ingest_done}
        if reading is not None:
            stage = "ingest"
            ingested = reading.result(spec.timeout_s)
        if arrived:  # Spark's scan and shuffle until the job's input brought its first rows
            phases["scan"] = arrived[0] - started
        phases["ingest"] = (reading.seconds if reading is not None else ingest_done - started) - phases.get("scan", 0.0)
    except BaseException as error:  # noqa: B036 - reported, then re-raised as RankFailure
        if reading is not None:
            reading.wait(spec.timeout_s)  # the part read beside is the worker's, held or not
        failure = describe(error, rank, stage, None)
        del error
        _teardown(clean=False)
        _report(launch, failure)
        raise RankFailure(failure, launch.secret) from None
    channel = _open_channel(launch, rank)
    forwarder = LogForwarder(channel, rank) if channel is not None else None
    if forwarder is not None:
        logging.getLogger().addHandler(forwarder)
    note = cpu_despite_gpus(device, barrier.gpus(), spec.use_gpu)
    if note is not None:
        logger.warning("rank %d: %s", rank, note)  # now the driver sees it
    try:
        gc.freeze()  # everything older than the trainer: the teardown's collection skips it
        deliver = (lambda run, data: channel.send_blob(f"{launch.job_id}/run{run}", data)) \
            if channel is not None and rank == 0 and spec.together else None
        failure, blob, ddp = _train_runs(spec, ingested, rank, device, ProgressReporter(channel, rank), phases,
                                         deliver)
        _teardown(clean=failure is None, ddp=ddp, store=store)
        if failure is not None:
            _report(launch, failure, channel)
        delivered = channel.send_blob(launch.job_id, blob) if blob is not None and channel is not None else None
        if delivered is not None:
            return delivered
    finally:
        gc.unfreeze()
        if forwarder is not None:
            logging.getLogger().removeHandler(forwarder)
        if channel is not None:
            channel.close()
    if failure is not None:
        raise RankFailure(failure, launch.secret)
    return blob


def _from_spark(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``batches``, the job's input; an error reading them is Spark's stream breaking off.

    Raises:
        SparkInputLost: PySpark could not read the next batch from Spark.
    """
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as error:
            raise SparkInputLost(f"Spark stopped sending this task's rows ({type(error).__name__}: {error}): the "
                                 "task was cancelled, as when another rank failed, or a stage before it failed "
                                 "(the Spark job's error says which)") from error
        yield batch


def _noting_first(batches: Iterator[pa.RecordBatch], arrived: list[float]) -> Iterator[pa.RecordBatch]:
    """``batches``, noting in ``arrived`` when the first came (``time.perf_counter()``)."""
    for batch in batches:
        if not arrived:
            arrived.append(time.perf_counter())
        yield batch


def _ingest(spec: TaskSpec, batches: Iterator[pa.RecordBatch], rank: int, staged: Sequence[str] = ()) -> IngestedRows:
    """This rank's rows: from the job's input (read from the ``staged`` files, where the
    staging job wrote them), or read from the table's files (see
    :mod:`spark_torch_est.ingest.parquet_plan`). A worker keeps the last part of a table it read: the
    next fit that gives this worker the same part of the same unchanged files (same size,
    modification time and footer), columns and budget trains on it again without reading."""
    ingested: IngestedRows | None
    if spec.source is None:
        if spec.kept is not None:
            return keep_while_reading(spec, batches, rank, staged)
        held.forget()  # a worker holds one fit's rows at a time
        ingested = read_rows(batches, spec.schema, spec.columns, spec.memory_budget)
        pa.default_memory_pool().release_unused()  # what Arrow freed while reading goes back to the system
        return ingested
    for _ in batches:  # the job's input: one row per rank, nothing to train on
        pass
    key = _part_key(spec, rank)
    ingested = held.held(key)
    if ingested is not None:
        logger.info("rank %d: training on the rows this worker read in an earlier fit (the files are unchanged)", rank)
        return ingested
    held.forget()
    source = spec.source
    rows = sum(part.stop - part.start for part in source.parts[rank])

    def read() -> IngestedRows:
        ingested = read_rows(read_part(source, rank), spec.schema, spec.columns, spec.memory_budget, rows)
        pa.default_memory_pool().release_unused()
        return ingested

    ingested = read()
    ingested.source, ingested.reread = key, read
    held.hold(key, ingested)
    return ingested


def _part_key(spec: TaskSpec, rank: int) -> str:
    """What a rank's part depends on: its rows, the files' identities (now) and
    footers (as planned), the input schema, the label and weight columns and the memory budget."""
    if spec.source is None:  # _ingest asks only for a spec that reads the table's files
        raise ValueError("a part key needs a spec whose ranks read files (spec.source)")
    part = spec.source.parts[rank]
    files = []
    for path in sorted({p.path for p in part}):
        fs, local = fsspec.core.url_to_fs(path)
        files.append([path, *file_stamp(fs, local)])
    planned = [stamp for stamp in spec.source.files if stamp[0] in {p.path for p in part}]  # footers as planned
    described = [spec.source.outputs, [[p.path, p.row_group, p.start, p.stop] for p in part], files, planned,
                 spec.schema.to_dict(), [spec.columns.label, spec.columns.weight], spec.memory_budget]
    return "files/" + hashlib.sha256(json.dumps(described, default=str).encode()).hexdigest()


class _Beside:
    """Runs ``work`` in a thread beside the rank's rendezvous (reading a table's files
    releases the GIL for most of its time); :meth:`result` waits for it.

    It is the only thread beside the rank's own before training, and starts once the rank's
    thread has set up what torch sets up on first use (its device, its NumPy bridge): in a
    fresh worker on torch 2.3.1 a thread importing or converting beside another that does
    deadlocked, each waiting in an import lock (a third thread importing ``torch._dynamo``
    ahead of the first step made it frequent; the loop now imports that itself).

    Args:
        work: What the thread runs; its value or exception comes out of :meth:`result`.
    """

    def __init__(self, work: Callable[[], IngestedRows]) -> None:
        self.seconds = 0.0
        self._value: IngestedRows | None = None
        self._error: BaseException | None = None
        torch.empty(0).numpy()  # torch's NumPy bridge, set up on this thread
        self._thread = threading.Thread(target=self._run, args=(work,), name="spark_torch_est-ingest", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], IngestedRows]) -> None:
        started = time.perf_counter()
        try:
            self._value = work()
        except BaseException as error:  # noqa: B036 - handed to the rank's thread by result()
            self._error = error
        self.seconds = time.perf_counter() - started

    def wait(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the work to end; whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self, timeout_s: float) -> IngestedRows:
        """The work's value (its exception raised here), within ``timeout_s`` (the ranks'
        collective timeout: the other ranks wait no longer for these rows either).

        Raises:
            TimeoutError: The work did not end in time.
        """
        if not self.wait(timeout_s):
            raise TimeoutError(f"reading the rank's part of the table took more than {timeout_s:.0f}s "
                               "(the timeout Param)")
        if self._error is not None:
            raise self._error
        if self._value is None:
            raise RuntimeError("a bug in spark_torch_est: the part read beside the rendezvous gave no rows")
        return self._value


def _open_channel(launch: Launch, rank: int) -> ChannelClient | None:
    """Connects to the driver's channel; training goes on without it."""
    if launch.channel_address is None:
        return None
    try:
        return ChannelClient(launch.channel_address, launch.secret)
    except Exception as error:  # unreachable driver or refused key: no live view, same result
        logger.info("rank %d: no channel to the driver (%s)", rank, error)
        return None


def _train_runs(spec: TaskSpec, ingested: IngestedRows, rank: int, device: torch.device, reporter: ProgressReporter,
                phases: dict[str, float], deliver: Callable[[int, bytes], str | None] | None = None
                ) -> tuple[Failure | None, bytes | None, list[weakref.ref]]:
    """Trains the job's run, then each run of ``spec.together`` in turn on the same rows and
    process group; as :func:`_train`. With several runs, rank 0 hands each run's checkpoint
    to ``deliver`` (the driver's channel: its SHA-256 once the driver holds it, else None)
    as the run ends and tells the driver, which can use that model while the next trains;
    its result then packs (:func:`pack_runs`) the checkpoints not delivered, ``b""`` for
    the others. The first failure ends the job."""
    if not spec.together:
        failure, blob, ddp, _ = _train(spec, ingested, rank, device, reporter, phases)
        return failure, blob, ddp
    kept: list[bytes] = []
    refs: list[weakref.ref] = []
    job = {name: getattr(spec, name) for name in JOB_FIELDS}  # as the launcher set them for this job (kept rows)
    for index, run in enumerate((spec, *spec.together)):
        failure, blob, ddp, progress = _train(replace(run, **job), ingested, rank, device, reporter,
                                              phases if index == 0 else None)
        refs.extend(ddp)
        if failure is not None:
            return failure, None, refs
        if blob is not None:  # rank 0
            delivered = deliver(index, blob) if deliver is not None else None
            kept.append(b"" if delivered else blob)
            reporter.run_done(index, progress, delivered or "")
        del blob
        gc.collect()  # the finished run's model and DDP wrapper (reference cycles) before the next is built
    return None, pack_runs(kept) if kept else None, refs


def _train(spec: TaskSpec, ingested: IngestedRows, rank: int, device: torch.device, reporter: ProgressReporter,
           phases: dict[str, float] | None = None
           ) -> tuple[Failure | None, bytes | None, list[weakref.ref], Progress]:
    """Runs the loop; returns plain data only, so no exception or frame keeps the DDP
    model alive into the teardown, and weak references to the DDP model and its Reducer
    for the teardown to check, and where the run ended. ``phases``: seconds of the launch's
    phases so far, for the loop's line on where the launch went."""
    from spark_torch_est.train.loop import Trainer

    trainer: Any = None
    try:
        creators: Creators = cloudpickle.loads(spec.payload)  # from the driver, inside the Spark task
        if spec.lightning is not None:  # a LightningModule: Lightning's own loop
            from spark_torch_est.train.lightning.trainer import LightningTrainer
            trainer = LightningTrainer(creators, spec, ingested, rank, spec.world_size, device, reporter)
        else:
            trainer = Trainer(creators, spec, ingested, rank, spec.world_size, device, reporter)
            trainer.phases.update(phases or {})
        blob = trainer.run()
        state = getattr(trainer, "state", None)
        return None, blob, _ddp_refs(trainer), state.progress if state is not None else Progress()
    except BaseException as error:  # noqa: B036 - turned into plain data for the driver
        stage = trainer.stage if trainer is not None else "setup"
        hook = trainer.hooks.current_hook if trainer is not None else None
        failure = describe(error, rank, stage, hook)
        logger.error("rank %d failed at %s: %s", rank, stage, failure.message,
                     extra={EXECUTOR_ONLY: True})  # the driver raises it: not forwarded
        error.__traceback__ = None
        return failure, None, _ddp_refs(trainer), Progress()


def _ddp_refs(trainer: object) -> list[weakref.ref]:
    """Weak references to what the trainer's strategy says holds the process group (the DDP
    wrapper and its Reducer; none without DDP)."""
    strategy = getattr(trainer, "strategy", None)
    return strategy.teardown_refs() if strategy is not None else []


def _device(spec: TaskSpec, barrier: Barrier) -> torch.device:
    device = task_device(spec.use_gpu, barrier.gpus(), barrier.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _report(launch: Launch, failure: Failure, channel: ChannelClient | None = None) -> None:
    """Sends the failure to the driver over the channel (a connection of its own when
    the rank has none yet) and waits until the driver holds it: the driver looks there
    for the root cause once Spark tells it the job failed. Only the job's ranks and the
    driver can read it (not the rendezvous store, which more can reach)."""
    client = channel if channel is not None else _open_channel(launch, failure.rank)
    if client is None:
        return
    try:
        if not client.report(failure):
            logger.warning("rank %d: the driver did not acknowledge the failure report", failure.rank)
    finally:
        if client is not channel:
            client.close()


def _teardown(clean: bool, ddp: Sequence[weakref.ref] = (), store: dist.Store | None = None) -> None:
    """Destroys the process group in the order that cannot hang a reused Python worker.

    DDP holds reference cycles, so only a garbage collection frees it (and its Reducer's
    hold on the process group) before ``destroy_process_group``. The caller froze the
    objects that predate training (``gc.freeze``), so the collection scans the training's
    own objects only: milliseconds instead of ~0.2 s with torch loaded. Should an older
    object still reach the DDP model, the full collection runs; should anything still hold
    it after that (a hook's global, say), it is kept for the life of the worker: freed
    after ``destroy_process_group`` it would hang the worker's next task.

    The ranks meet in the store, not with ``dist.barrier()``: gloo's barrier keeps the
    collectives still in flight. A gloo thread that drops the last reference to a finished
    collective's tensors (Python's, freed with the GIL) while ``destroy_process_group``
    holds the GIL and joins that thread deadlocks (torch 2.3 and 2.6: seen with a barrier's
    and an all-gather's work); so before destroying, this thread lets go of the GIL for a
    moment (:data:`_GIL_RELEASE_S`), with no tensor of the group left to free after it.

    Args:
        clean: The ranks finished together (meet first).
        ddp: Weak references to the DDP model and its Reducer (see :func:`_ddp_refs`).
        store: The job's store, where the ranks meet.
    """
    if not dist.is_initialized():
        return
    if clean and store is not None:
        try:
            store.set(f"teardown/{dist.get_rank()}", "1")
            store.wait([f"teardown/{peer}" for peer in range(dist.get_world_size())])
        except (RuntimeError, dist.DistError):
            clean = False
    gc.collect()
    if any(ref() is not None for ref in ddp):
        gc.unfreeze()
        gc.collect()
        alive = [obj for obj in (ref() for ref in ddp) if obj is not None]
        if alive:
            logger.warning("the DDP model is still referenced after training (by a hook or a global?); this worker "
                           "keeps it rather than free it after its process group is gone")
            _KEPT_ALIVE.extend(alive)
    time.sleep(_GIL_RELEASE_S)  # not an ordering of ours: torch's threads need the GIL to finish
    dist.destroy_process_group()
    logger.debug("process group destroyed (pid %d, clean=%s)", os.getpid(), clean)
