"""[driver] The barrier job: slots, rendezvous store, launch, cancel, errors, relaunches."""

from __future__ import annotations

import dataclasses
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pyspark import SparkContext
from pyspark.sql import DataFrame, SparkSession

from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.checkpoints.storage import CheckpointDir
from spark_torch_est.cluster.channel import ChannelServer
from spark_torch_est.cluster.failure import Decision, FailurePolicy, explain_job_failure, is_spark_error, package_bug
from spark_torch_est.cluster.messages import RankMessage
from spark_torch_est.cluster.spark_log import TASK_PROPERTY, TASK_VALUE, quiet_task_failures
from spark_torch_est.cluster.store_gate import StoreGate
from spark_torch_est.cluster.worker import train_task
from spark_torch_est.core.jvm import collect_arrow, task_slots
from spark_torch_est.core.progress import Progress
from spark_torch_est.core.protocol import DELIVERED, RESULT_SCHEMA
from spark_torch_est.core.running import fit_logger
from spark_torch_est.core.spec import FileSource, Launch, TaskSpec
from spark_torch_est.errors import InvalidInputError, SparkTorchError, TrainingFailedError
from spark_torch_est.ingest.kept_registry import KeptIngest

__all__ = ["Launcher", "wait_for_slots"]

logger = fit_logger(__name__)

_LOCAL_MASTER = re.compile(r"^local(\[[^\]]*\])?$")


def wait_for_slots(spark: SparkSession, needed: int, timeout_s: float, minimum: int | None = None) -> int:
    """Waits (bounded) for executors to offer ``needed`` slots at once.

    Args:
        spark: The session.
        needed: The ranks wanted (``numWorkers``).
        timeout_s: The longest wait (``slotWaitTimeout``); local mode, which can never
            gain slots, does not wait.
        minimum: The fewest ranks a launch may train with (``minWorkers``); None: ``needed``.

    Returns:
        The ranks to launch: ``needed``, or the slots there are when fewer but at least
        ``minimum`` remain after the wait.

    Raises:
        InvalidInputError: Fewer than ``minimum`` slots after the wait; says how many there are.
    """
    minimum = needed if minimum is None else minimum
    deadline = time.monotonic() + timeout_s
    slots = task_slots(spark)
    while slots is not None and slots < needed:
        conf = spark.sparkContext.getConf()
        master = conf.get("spark.master", "?")
        local = bool(_LOCAL_MASTER.match(master))  # local mode never gains slots: do not wait
        if local or time.monotonic() >= deadline:
            waited = "local mode cannot add slots" if local else f"waited {timeout_s:.0f}s, see slotWaitTimeout"
            if slots >= minimum:
                logger.warning("only %d of numWorkers=%d task slots are free (%s): training on %d ranks "
                               "(minWorkers=%d) that keep the global batch of batchSize * numWorkers rows", slots,
                               needed, waited, slots, minimum)
                return slots
            fewest = f"minWorkers={minimum} needs {minimum}" if minimum < needed else f"needs {needed}"
            raise InvalidInputError(
                f"numWorkers={needed} {fewest} task slots at once, but the cluster offers {slots} "
                f"(master={master}, spark.task.cpus={conf.get('spark.task.cpus', '1')}, {waited}); "
                "lower numWorkers" + (" or minWorkers" if minimum < needed else "") + " or add executor cores"
                + (f" (e.g. master local[{needed}])" if local else "")
            )
        logger.info("waiting for task slots: %d of %d available", slots, needed)
        time.sleep(0.5)  # polling the scheduler, not synchronizing
        slots = task_slots(spark)
    return needed


def _driver_host(spark: SparkSession) -> str | None:
    try:
        return spark.sparkContext.getConf().get("spark.driver.host")
    except Exception:  # Spark Connect: the client is not the driver
        return None


def _max_blob() -> int | None:
    """The largest checkpoint the channel accepts: half of the memory the driver's machine
    has available when the job starts (None where that cannot be read). The channel is the
    path for checkpoints past ``spark.driver.maxResultSize``, so that setting does not bound
    it; this keeps a client holding the job's secret from making the driver take more."""
    try:
        with open("/proc/meminfo") as meminfo:
            available_kb = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return available_kb * 1024 // 2


class Launcher:
    """Runs the barrier training jobs of one fit, relaunching from checkpoints after
    failures a relaunch can fix (see :class:`failure.FailurePolicy`).

    Args:
        spark: The session of the training DataFrame.
        rows: What the jobs read: the prepared training DataFrame (see
            :func:`frames.training_frame`) or the rows the executors kept of it.
        max_retries: Relaunches allowed after retryable failures.
        slot_wait_s: Longest wait for free task slots before each launch.
        on_message: Receives the ranks' progress and log messages (driver threads).
        min_workers: The fewest ranks a launch may train with (``minWorkers``); None: all
            of the spec's ``world_size``.
        replan: ``replan(ranks)`` gives the training frame and the files to read of a job
            of fewer ranks (needed with ``min_workers``).
        on_ask: ``on_ask(epoch)``: whether the fit stops at the end of ``epoch``, rank 0's
            question when a driver-side logger may stop the fit (see ``TaskSpec.stop_wait_s``).
    """

    def __init__(self, spark: SparkSession, rows: KeptIngest, max_retries: int, slot_wait_s: float,
                 on_message: Callable[[RankMessage], None] | None = None, min_workers: int | None = None,
                 replan: Callable[[int], tuple[DataFrame, FileSource | None]] | None = None,
                 on_ask: Callable[[int], bool] | None = None) -> None:
        self._store_unreachable: set[str] = set()  # driver hosts executors could not reach in this fit
        self.spark = spark
        self.rows = rows
        self.max_retries = max_retries
        self.slot_wait_s = slot_wait_s
        self.on_message = on_message or (lambda message: None)
        self.min_workers = min_workers
        self.replan = replan
        self.on_ask = on_ask
        self._frames: dict[int, tuple[DataFrame, FileSource | None]] = {}
        self._grown_at = -float("inf")  # when this fit last grew back (monotonic seconds)

    def run(self, spec: TaskSpec, start: Progress) -> bytes:
        """Trains; returns rank 0's checkpoint bytes.

        Args:
            spec: The fit.
            start: The progress ``spec.resume`` holds (``Progress()`` for a new run).

        Raises:
            SparkTorchError: The job failed for good.
            KeyboardInterrupt: The fit was interrupted; the job was cancelled first.
        """
        policy = FailurePolicy(self.max_retries)
        quiet_task_failures(self.spark)
        fit_start = start
        while True:
            launch = Launch(job_id=f"ste-{uuid.uuid4().hex[:12]}", secret=secrets.token_bytes(32))
            ranks = wait_for_slots(self.spark, spec.world_size, self.slot_wait_s, self.min_workers)
            job, frame = self._sized(spec, ranks)
            logger.info("launching training job %s on %d of numWorkers=%d ranks (%d rows per rank per step), "
                        "from %s", launch.job_id, ranks, spec.world_size, job.batch_size, start)
            try:
                checkpoint = self._launch(job, launch, frame, spec.world_size)
                self.rows.succeeded(job)
                return checkpoint
            except _SlotsLost as lost:
                logger.warning("%s: cancelled the job, launching again (not counted in maxRetries)", lost)
            except _GrowBack as grow:
                self._grown_at = time.monotonic()
                logger.warning("%s: cancelled the job, growing the run from %d to numWorkers=%d ranks (not counted "
                               "in maxRetries)", grow, ranks, spec.world_size)
            except SparkTorchError as error:
                if self.rows.missing(error):  # read through Spark instead: not counted in maxRetries
                    continue
                slots = self._slots_lost(error, ranks)
                if slots is not None:  # a lost executor failed the job before the watch saw it go
                    logger.warning("%s: the cluster's task slots fell to %d while the job needed %d, launching "
                                   "again (not counted in maxRetries)", error, slots, ranks)
                    spec, start = self._relaunch_spec(spec, start)
                    self.rows.relaunching()
                    continue
                decision = policy.decide(error)
                if decision is Decision.RAISE:
                    _point_to_checkpoint(error, spec, fit_start)
                    raise
                if decision is Decision.REROUTE:
                    self._store_unreachable.add(_driver_host(self.spark) or "")
                    continue
            spec, start = self._relaunch_spec(spec, start)
            self.rows.relaunching()

    def _slots_lost(self, error: SparkTorchError, ranks: int, grace_s: float = 3.0) -> int | None:
        """The cluster's task slots when they fell below ``ranks`` by the time the job
        failed (a relaunch can fix the failure, and Spark has ``grace_s`` to see the lost
        executor), else None."""
        if not (isinstance(error, TrainingFailedError) and error.retryable) or task_slots(self.spark) is None \
                or _LOCAL_MASTER.match(self.spark.sparkContext.getConf().get("spark.master", "")):
            return None  # local mode loses no executor
        deadline = time.monotonic() + grace_s
        while True:
            slots = task_slots(self.spark)
            if slots is not None and slots < ranks:
                return slots
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    def _sized(self, spec: TaskSpec, ranks: int) -> tuple[TaskSpec, DataFrame]:
        """The fit as a job of ``ranks`` ranks, and its frame: the spec's own, or one shrunk
        to fewer ranks with the same global batch (see :meth:`TaskSpec.shrunk`)."""
        if ranks == spec.world_size:
            return self.rows.spec(spec), self.rows.frame
        if ranks not in self._frames:
            if self.replan is None:  # the Launcher's contract: min_workers comes with replan
                raise TypeError(f"a job of {ranks} ranks instead of {spec.world_size} needs the Launcher's replan")
            self._frames[ranks] = self.replan(ranks)
        frame, source = self._frames[ranks]
        shrunk = spec.shrunk(ranks, source)
        if shrunk.batch_size * ranks != spec.batch_size * spec.world_size:
            logger.warning("batchSize * numWorkers = %d rows do not divide among %d ranks: each takes %d per step",
                           spec.batch_size * spec.world_size, ranks, shrunk.batch_size)
        return shrunk, frame

    def _relaunch_spec(self, spec: TaskSpec, start: Progress) -> tuple[TaskSpec, Progress]:
        """The same target, resumed from the newest checkpoint in checkpointDir that this fit
        wrote and that is newer than ``start`` (found by name, newest first; a later point of
        the run that another fit wrote is read and passed over)."""
        files = CheckpointDir(spec.checkpoint_dir, run_id=spec.run_id).files() if spec.checkpoint_dir else []
        for file in (f for f in files if f.global_step > start.global_step):
            blob = file.read()
            checkpoint = Checkpoint.from_bytes(blob)
            if (checkpoint.run_id, checkpoint.fit_id) == (spec.run_id, spec.fit_id):  # this fit's newest
                spec, start = dataclasses.replace(spec, resume=blob, fresh_hooks=()), checkpoint.progress
                break
        logger.warning("the relaunch resumes from %s", start if spec.resume is not None else "the start of the run")
        return spec, start

    @contextmanager
    def _driver_services(self, launch: Launch, ranks: int) -> Iterator[tuple[Launch, ChannelServer | None]]:
        """The rendezvous store's gate (one connection per rank) and the message channel,
        both bound to the driver host; yields the launch with their addresses."""
        host = _driver_host(self.spark)
        store = channel = None
        if host is not None and host not in self._store_unreachable:
            try:
                store = StoreGate(host, launch.secret, max_connections=ranks, timeout_s=60.0)
            except OSError as error:
                logger.warning("cannot open a rendezvous store on %s (%s); using Spark's allGather", host, error)
        if host is not None:
            try:
                channel = ChannelServer(host, launch.secret, self.on_message, max_blob_bytes=_max_blob(),
                                        on_ask=self.on_ask)
            except OSError as error:
                logger.warning("cannot open the driver's channel on %s (%s); no live progress", host, error)
        launch = dataclasses.replace(launch, store_address=store.address if store is not None else None,
                                     channel_address=channel.address if channel is not None else None)
        try:
            yield launch, channel
        finally:
            if channel is not None:
                channel.close()
            if store is not None:
                store.close()

    def _launch(self, spec: TaskSpec, launch: Launch, frame: DataFrame, wanted: int | None = None) -> bytes:
        with self._driver_services(launch, spec.world_size) as (launch, channel):
            started = time.perf_counter()
            try:
                table = self._collect(spec, launch, frame, self._grow_watch(spec, wanted))
            except (SparkTorchError, _SlotsLost, _GrowBack):
                raise
            except Exception as error:
                if not is_spark_error(error):
                    raise package_bug(error) from error
                reported = [failure for failure in (channel.failures() if channel is not None else [])
                            if failure.rank < spec.world_size]
                raise explain_job_failure(str(error), reported, launch.secret) from None
            logger.info("training job %s finished on %d ranks in %.1fs", launch.job_id, spec.world_size,
                        time.perf_counter() - started)
            return _checkpoint_bytes(table, channel, launch.job_id)

    def _grow_watch(self, job: TaskSpec, wanted: int | None) -> _GrowWatch | None:
        """What watches a shrunk job for the slots to come back: only with periodic
        checkpoints to grow at, and at most once per ``slotWaitTimeout``."""
        if wanted is None or job.world_size >= wanted or not job.checkpoint_dir or job.checkpoint_every is None:
            return None
        if time.monotonic() - self._grown_at < self.slot_wait_s:
            return None
        return _GrowWatch(self.spark, wanted, CheckpointDir(job.checkpoint_dir, run_id=job.run_id))

    def _collect(self, spec: TaskSpec, launch: Launch, frame: DataFrame, grow: _GrowWatch | None = None):
        """Runs the job in a thread so the driver can tick, turn Ctrl-C into a cancel, and
        cancel a job whose ranks can no longer all have a slot (an executor was lost), which
        Spark would otherwise retry for minutes waiting for every slot, or a shrunk job
        whose slots came back, once it wrote its next checkpoint (``grow``).

        Raises:
            _SlotsLost: The cluster's task slots fell below the job's ranks.
            _GrowBack: The slots of ``numWorkers`` ranks are back and a checkpoint to grow at is written.
        """
        with _shipped(self.spark, spec) as shipped:
            job = frame.mapInArrow(train_task(shipped, launch), RESULT_SCHEMA, barrier=True)
            return self._run_job(job, launch, spec.world_size, grow)

    def _run_job(self, job: DataFrame, launch: Launch, ranks: int, grow: _GrowWatch | None = None):
        group = f"spark_torch_est-{launch.job_id}"
        control = _JobControl(self.spark, group)
        outcome: dict = {}

        def collect() -> None:
            control.enter()
            try:
                outcome["table"] = collect_arrow(job)
            except BaseException as error:  # noqa: B036 - handed to the calling thread
                outcome["error"] = error

        thread = threading.Thread(target=collect, name=group, daemon=True)
        thread.start()
        checked, watch = time.monotonic(), task_slots(self.spark) is not None  # None: Spark Connect
        try:
            while thread.is_alive():
                thread.join(0.2)
                if watch and thread.is_alive() and time.monotonic() - checked >= 1.0:
                    checked = time.monotonic()
                    slots = task_slots(self.spark)
                    if slots is not None and slots < ranks:
                        control.cancel()
                        thread.join(60)
                        raise _SlotsLost(f"the cluster's task slots fell to {slots} while job {launch.job_id} "
                                         f"needed {ranks}")
                    reason = grow.ready(slots) if grow is not None and slots is not None else None
                    if reason is not None:
                        control.cancel()
                        thread.join(60)
                        raise _GrowBack(f"job {launch.job_id} on {ranks} ranks: {reason}")
        except KeyboardInterrupt:
            logger.warning("interrupted: cancelling the training job")
            control.cancel()
            thread.join(60)
            raise
        if "error" in outcome:
            raise outcome["error"]
        return outcome["table"]


@contextmanager
def _shipped(spark: SparkSession, spec: TaskSpec) -> Iterator[TaskSpec | Any]:
    """The spec as the job's function carries it: a Spark broadcast, removed (file and
    blocks) when the job is over. PySpark writes a task function past 1 MB (a resumed
    checkpoint, a model passed as an instance) to a file in its temporary directory that
    lasts the session; the job's secret, which the function carries, would be in it. As a
    broadcast of its own, the spec's file holds no secret and is deleted after the job.
    Under Spark Connect the spec travels in the function."""
    try:
        context = spark.sparkContext
    except Exception:  # Spark Connect: no broadcasts from the client
        yield spec
        return
    broadcast = context.broadcast(spec)
    try:
        yield broadcast
    finally:
        try:
            broadcast.destroy()
        except Exception as error:  # a stopped context: nothing left to remove from
            logger.debug("could not remove the spec's broadcast: %s", error)


def _point_to_checkpoint(error: SparkTorchError, spec: TaskSpec, start: Progress) -> None:
    """A failed fit that wrote periodic checkpoints past ``start`` says so in its error, and
    how to continue from the newest: the estimator's run stays where the fit started."""
    if not spec.checkpoint_dir or not isinstance(error, TrainingFailedError):
        return
    try:
        newest = CheckpointDir(spec.checkpoint_dir, run_id=spec.run_id).newest()
    except (OSError, ValueError) as failure:  # unreadable storage: the error stays as it is
        logger.debug("cannot list checkpointDir after the failure: %s", failure)
        return
    if newest is None or newest.global_step <= start.global_step:
        return
    error.message += (f"; this fit wrote checkpoints to checkpointDir, the newest at epoch {newest.epoch}, global "
                      f"step {newest.global_step}: continue from it with est.fit(df, resume_from={newest.url!r}) "
                      "(a plain est.fit(df) starts again where this fit started, as a branch: a new run)")
    error.args = (error.message,)


class _SlotsLost(Exception):
    """The cluster lost task slots the running job needs (see :meth:`Launcher._collect`)."""


class _GrowBack(Exception):
    """A shrunk job's slots are back and it wrote a checkpoint to grow at (see :class:`_GrowWatch`)."""


class _GrowWatch:
    """Watches a job running on fewer than ``numWorkers`` ranks: once the cluster offers
    ``wanted`` slots again, the next checkpoint the run writes is where it grows.

    Args:
        spark: The session.
        wanted: ``numWorkers``.
        checkpoints: The run's checkpointDir.
    """

    def __init__(self, spark: SparkSession, wanted: int, checkpoints: CheckpointDir) -> None:
        self.spark, self.wanted, self.checkpoints = spark, wanted, checkpoints
        self._newest_when_back: int | None = None  # global step of the newest checkpoint when the slots came back

    def ready(self, slots: int) -> str | None:
        """Why the job should end now to grow back, or None (called about once a second)."""
        if self._newest_when_back is None:
            if slots < self.wanted:
                return None
            self._newest_when_back = self._newest_step()
            logger.info("the cluster offers numWorkers=%d task slots again: the run grows at its next checkpoint",
                        self.wanted)
            return None
        step = self._newest_step()
        if step <= self._newest_when_back:
            return None
        if slots < self.wanted:  # gone again before the checkpoint: keep training as it is
            self._newest_when_back = None
            return None
        return f"{slots} task slots are free again and the run wrote its checkpoint at global step {step}"

    def _newest_step(self) -> int:
        try:
            newest = self.checkpoints.newest()
        except (OSError, ValueError) as error:  # unreadable storage: no growing on it
            logger.debug("cannot list checkpointDir: %s", error)
            return -1
        return newest.global_step if newest is not None else -1


def _checkpoint_bytes(table, channel: ChannelServer | None, job_id: str) -> bytes:
    """Rank 0's checkpoint: from the channel when its one result row says it was delivered
    there, else joined from its ordered result rows."""
    rows = sorted(zip(table.column("seq").to_pylist(), table.column("data").to_pylist()))
    if not rows:  # Spark ran no task at all: it proved the input empty
        raise InvalidInputError("the training DataFrame has no rows (Spark ran no training task)")
    if rows[0][0] != DELIVERED:
        if channel is not None:
            logger.warning("the checkpoint came back as result rows, not over the channel (see rank 0's log)")
        return b"".join(chunk for _, chunk in rows)
    blob = channel.take_blob(job_id, rows[0][1].decode()) if channel is not None else None
    if blob is None:
        raise TrainingFailedError("rank 0 reported its checkpoint delivered over the channel, but the driver "
                                  "does not hold it", retryable=True)
    return blob


class _JobControl:
    """A job group (classic Spark) or tag (Spark Connect) that cancels just this fit's job."""

    def __init__(self, spark: SparkSession, name: str) -> None:
        self.spark = spark
        self.name = name
        self.context: SparkContext | None
        try:
            self.context = spark.sparkContext
        except Exception:  # Spark Connect
            self.context = None

    def enter(self) -> None:
        """Marks jobs started by the calling thread."""
        if self.context is not None:
            self.context.setJobGroup(self.name, "spark_torch_est training", interruptOnCancel=True)
            self.context.setLocalProperty(TASK_PROPERTY, TASK_VALUE)  # see spark_log.py
        else:
            self.spark.addTag(self.name)

    def cancel(self) -> None:
        """Cancels every job of the group."""
        if self.context is not None:
            self.context.cancelJobGroup(self.name)
        else:
            self.spark.interruptTag(self.name)
