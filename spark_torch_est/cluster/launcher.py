"""[driver] The barrier jobs of a fit: rendezvous store, launch, cancel, each job's outcome, and the
controller loop that applies the policies' decisions (see :mod:`~spark_torch_est.cluster.control`)."""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import pyarrow as pa
from pyspark import SparkContext
from pyspark.sql import DataFrame, SparkSession

from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.checkpoints.storage import CheckpointDir
from spark_torch_est.cluster.channel import ChannelServer
from spark_torch_est.cluster.control import (
    LOCAL_MASTER,
    Action,
    Failed,
    FailurePolicy,
    Finished,
    GrowBack,
    GrowWatch,
    Launches,
    Outcome,
    RowsMissing,
    ScalingPolicy,
    SlotsLost,
    StoreUnreachable,
    wait_for_slots,
)
from spark_torch_est.cluster.failure import StoreUnreachableError, explain_job_failure, is_spark_error, package_bug
from spark_torch_est.cluster.messages import Kind, RankMessage
from spark_torch_est.cluster.spark_log import TASK_PROPERTY, TASK_VALUE, quiet_task_failures
from spark_torch_est.cluster.store_gate import StoreGate
from spark_torch_est.cluster.worker import train_task
from spark_torch_est.core.jvm import collect_arrow, context_setting, task_slots
from spark_torch_est.core.progress import Progress
from spark_torch_est.core.protocol import DELIVERED, RESULT_SCHEMA
from spark_torch_est.core.running import fit_logger
from spark_torch_est.core.spec import FileSource, Launch, TaskSpec
from spark_torch_est.errors import IncompatibleCheckpointError, InvalidInputError, SparkTorchError, TrainingFailedError
from spark_torch_est.ingest.kept_registry import KeptIngest

__all__ = ["STAGING", "Launcher", "wait_for_slots"]

logger = fit_logger()

#: The phase a fit shows while its staging job runs (see :meth:`Launcher._staged`).
STAGING = ("Spark computes the DataFrame's rows and writes them out for the ranks (a job over its partitions, "
           "instead of a shuffle)")


def _driver_host(spark: SparkSession) -> str | None:
    try:
        return context_setting(spark.sparkContext, "spark.driver.host")
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


def _partitions(spec: TaskSpec, ranks: int) -> int | None:
    """The logical partitions of the training frame of a job of ``ranks`` ranks: the run's
    shards (a new run's are its first job's ranks), or None when the ranks hash the rows."""
    return (spec.shards or ranks) if spec.ordered else None


class Launcher:
    """Runs the barrier training jobs of one fit: a small controller. Each job ends in one
    outcome (see :mod:`~spark_torch_est.cluster.control`); the failure and scaling policies
    turn it into a decision, which :meth:`run` applies: return, relaunch (from the newest
    checkpoint this fit wrote), read the rows through Spark, reroute, grow back or raise.

    Args:
        spark: The session of the training DataFrame.
        rows: What the jobs read: the prepared training DataFrame (see
            :func:`frames.training_frame`) or the rows the executors kept of it.
        max_retries: Relaunches allowed after retryable failures.
        slot_wait_s: Longest wait for free task slots before each launch.
        on_message: Receives the ranks' progress and log messages (driver threads).
        min_workers: The fewest ranks a launch may train with (``minWorkers``); None: all
            of the spec's ``world_size``.
        replan: ``replan(ranks, partitions)`` gives the training frame and the files to read
            of a job of other ranks, or of rows in other logical partitions (None: placed
            by hashing), than ``rows`` (needed with ``min_workers``).
        on_ask: ``on_ask(epoch)``: whether the fit stops at the end of ``epoch``, rank 0's
            question when a driver-side logger may stop the fit (see ``TaskSpec.stop_wait_s``).
        on_run: ``on_run(run, checkpoint)``: each run's checkpoint as rank 0 delivers it, in
            a job that trains several in turn (``TaskSpec.together``); called from a channel
            thread while the job goes on.
        on_phase: ``on_phase(STAGING)`` as a staging job starts (Spark computes the rows and
            writes them out for the ranks: the rows' whole computation happens in it), then
            ``on_phase(None)`` as the training job starts after it (not when its failure
            fails the fit).
    """

    def __init__(self, spark: SparkSession, rows: KeptIngest, max_retries: int, slot_wait_s: float,
                 on_message: Callable[[RankMessage], None] | None = None, min_workers: int | None = None,
                 replan: Callable[[int, int | None], tuple[DataFrame, FileSource | None]] | None = None,
                 on_ask: Callable[[int], bool] | None = None,
                 on_run: Callable[[int, bytes], None] | None = None,
                 on_phase: Callable[[str | None], None] | None = None) -> None:
        self._store_unreachable: set[str] = set()  # driver hosts executors could not reach in this fit
        self.spark = spark
        self.rows = rows
        self.max_retries = max_retries
        self.slot_wait_s = slot_wait_s
        self.on_message = on_message or (lambda message: None)
        self.min_workers = min_workers
        self.replan = replan
        self.on_ask = on_ask
        self.on_run = on_run
        self.on_phase = on_phase or (lambda text: None)
        self._stop = threading.Event()
        self._frames: dict[tuple[int, int | None], tuple[DataFrame, FileSource | None]] = {}
        self._partitions: int | None = None  # the logical partitions of ``rows``' frame

    def run(self, spec: TaskSpec, start: Progress) -> bytes:
        """Trains; returns rank 0's checkpoint bytes.

        Args:
            spec: The fit.
            start: The progress ``spec.resume`` holds (``Progress()`` for a new run).

        Raises:
            SparkTorchError: The job failed for good.
            KeyboardInterrupt: The fit was interrupted; the job was cancelled first.
        """
        launches = Launches(self.max_retries)
        failures = FailurePolicy(launches)
        scaling = ScalingPolicy(self.spark, spec.world_size, self.min_workers, self.slot_wait_s, launches)
        quiet_task_failures(self.spark)
        self._partitions = _partitions(spec, spec.world_size)
        fit_start = mark = start
        while True:
            ranks = scaling.ranks()
            job, frame = self._planned(spec, ranks)
            launch = Launch(job_id=f"ste-{uuid.uuid4().hex[:12]}", secret=secrets.token_bytes(32))
            logger.info("launching training job %s on %d of numWorkers=%d ranks (%d rows per rank per step), "
                        "from %s", launch.job_id, ranks, spec.world_size, job.batch_size, start)
            outcome = self._job(job, launch, frame, scaling.grow_watch(job))
            launches.end(outcome)
            if isinstance(outcome, Finished):
                self.rows.succeeded(job)
                return outcome.checkpoint
            try:
                resumed, newest = self._relaunch_spec(spec, start)  # this fit's newest checkpoint
            except OSError as unreadable:  # checkpointDir unreadable now: from where the last job started
                logger.warning("cannot list checkpointDir %s: %s", spec.checkpoint_dir, unreadable)
                resumed, newest = spec, start
            if newest.global_step > mark.global_step:  # progress since the bound last started again
                launches.progressed()
                mark = newest
            decision = scaling.decide(outcome) if isinstance(outcome, GrowBack) else failures.decide(outcome)
            if decision.action is Action.RAISE:
                error = decision.error or TrainingFailedError(decision.reason)
                _point_to_checkpoint(error, spec, fit_start)
                raise error
            if decision.action is Action.REREAD:
                self.rows.read_again()
            elif decision.action is Action.REROUTE:
                self._store_unreachable.add(_driver_host(self.spark) or "")
            else:  # RELAUNCH, RESIZE: from the newest checkpoint this fit wrote
                spec, start = resumed, newest
                logger.warning("the relaunch resumes from %s",
                               start if spec.resume is not None else "the start of the run")
                self.rows.relaunching()

    def stop(self) -> None:
        """Cancels the running job from another thread, as Ctrl-C in :meth:`run`'s would:
        :meth:`run` then raises KeyboardInterrupt."""
        self._stop.set()

    def _job(self, job: TaskSpec, launch: Launch, frame: DataFrame, grow: GrowWatch | None) -> Outcome:
        """Runs one job of ``job.world_size`` ranks; how it ended."""
        try:
            return self._launch(job, launch, frame, grow)
        except SparkTorchError as error:
            if self.rows.missing(error):
                return RowsMissing(error)
            if isinstance(error, StoreUnreachableError):
                return StoreUnreachable(error)
            slots = self._slots_lost(error, job.world_size)
            if slots is not None:  # a lost executor failed the job before the watch saw it go
                return SlotsLost(slots, job.world_size, error)
            return Failed(error)

    def _slots_lost(self, error: SparkTorchError, ranks: int, grace_s: float = 3.0) -> int | None:
        """The cluster's task slots when they fell below ``ranks`` by the time the job
        failed (a relaunch can fix the failure, and Spark has ``grace_s`` to see the lost
        executor), else None."""
        if not (isinstance(error, TrainingFailedError) and error.retryable) or task_slots(self.spark) is None \
                or LOCAL_MASTER.match(self.spark.sparkContext.getConf().get("spark.master", "")):
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
        """The fit as a job of ``ranks`` ranks, and its frame: the spec's own, or one of other
        ranks with the same global batch (see :meth:`TaskSpec.shrunk`), or of the logical
        partitions of the checkpoint it resumes."""
        partitions = _partitions(spec, ranks)
        if ranks == spec.world_size and partitions == self._partitions:
            return self.rows.spec(spec), self.rows.frame
        if (ranks, partitions) not in self._frames:
            if self.replan is None:  # the Launcher's contract: min_workers comes with replan
                raise TypeError(f"a job of {ranks} ranks instead of {spec.world_size} needs the Launcher's replan")
            self._frames[ranks, partitions] = self.replan(ranks, partitions)
        frame, source = self._frames[ranks, partitions]
        shrunk = spec.shrunk(ranks, source)
        if shrunk.batch_size * ranks != spec.batch_size * spec.world_size:
            logger.warning("batchSize * numWorkers = %d rows do not divide among %d ranks: each takes %d per step",
                           spec.batch_size * spec.world_size, ranks, shrunk.batch_size)
        return shrunk, frame

    def _planned(self, spec: TaskSpec, ranks: int) -> tuple[TaskSpec, DataFrame]:
        """:meth:`_sized`, whose first call plans the kept rows. Describing a cached frame's
        plan can compute its rows in a Spark job (see ``jvm.describe_plan``): a failure that
        a relaunch cannot fix (the DataFrame's own error) fails the fit there, before any
        other job meets it again (Spark 3.5.0 hangs the next job over a cache whose rows an
        Arrow function failed to compute); any other keeps nothing of this fit's rows.

        Raises:
            SparkTorchError: That failure, explained.
        """
        try:
            return self._sized(spec, ranks)
        except Exception as error:
            if not is_spark_error(error):
                raise
            _raise_lasting(error)
            logger.warning("the rows of this DataFrame are not kept between fits: computing them to describe its "
                           "cache failed (%s)", str(error).strip().splitlines()[0][:300])
            return self._sized(spec, ranks)  # the rows' plan stays None: nothing is kept

    def _relaunch_spec(self, spec: TaskSpec, start: Progress) -> tuple[TaskSpec, Progress]:
        """The same target, resumed from the newest checkpoint in checkpointDir that this fit
        wrote and that is newer than ``start`` (found by name, newest first; a later point of
        the run that another fit wrote is read and passed over)."""
        files = CheckpointDir(spec.checkpoint_dir, run_id=spec.run_id).files() if spec.checkpoint_dir else []
        for file in (f for f in files if f.global_step > start.global_step):
            try:
                blob = file.read()
            except OSError as error:  # not a regular file of the folder, or unreadable: not this fit's
                logger.warning("passing over %s: %s", file.url, error)
                continue
            try:
                checkpoint = Checkpoint.from_bytes(blob)
            except IncompatibleCheckpointError as error:  # a regular file that is no checkpoint: not this fit's
                logger.warning("passing over %s: %s", file.url, error)
                continue
            if (checkpoint.run_id, checkpoint.fit_id) == (spec.run_id, spec.fit_id):  # this fit's newest
                spec = dataclasses.replace(spec, resume=blob, fresh_hooks=(), shards=checkpoint.shards)
                start = checkpoint.progress
                break
        return spec, start

    @contextmanager
    def _driver_services(self, launch: Launch, ranks: int, runs: int) -> Iterator[tuple[Launch, ChannelServer | None]]:
        """The rendezvous store's gate (one connection per rank) and the message channel,
        both bound to the driver host, for a job of ``runs`` runs; yields the launch with
        their addresses."""
        host = _driver_host(self.spark)
        store = channel = None
        if host is not None and host not in self._store_unreachable:
            try:
                store = StoreGate(host, launch.secret, max_connections=ranks, timeout_s=60.0)
            except OSError as error:
                logger.warning("cannot open a rendezvous store on %s (%s); using Spark's allGather", host, error)
        if host is not None:
            def handle(message: RankMessage) -> None:  # a run's checkpoint first, as its message arrives
                if message.kind is Kind.RUN_DONE and message.text and self.on_run is not None and channel is not None:
                    blob = channel.take_blob(f"{launch.job_id}/run{message.run}", message.text)
                    if blob is not None:
                        self.on_run(message.run, blob)
                self.on_message(message)

            try:
                channel = ChannelServer(host, launch.secret, handle, max_blob_bytes=_max_blob(), on_ask=self.on_ask,
                                        max_blobs=runs + (runs > 1))
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

    def _launch(self, spec: TaskSpec, launch: Launch, frame: DataFrame,
                grow: GrowWatch | None = None) -> Finished | SlotsLost | GrowBack:
        """Runs the job with the driver's services: finished, or cancelled as the slots fell
        or came back.

        Raises:
            SparkTorchError: The job failed.
        """
        with self._driver_services(launch, spec.world_size, 1 + len(spec.together)) as (launch, channel):
            started = time.perf_counter()
            try:
                spec, frame = self._staged(spec, launch, frame)
                ended = self._collect(spec, launch, frame, grow)
            except SparkTorchError:
                raise
            except Exception as error:
                if not is_spark_error(error):
                    raise package_bug(error) from error
                reported = [failure for failure in (channel.failures() if channel is not None else [])
                            if failure.rank < spec.world_size]
                raise explain_job_failure(str(error), reported, launch.secret) from None
            if not isinstance(ended, pa.Table):
                return ended
            logger.info("training job %s finished on %d ranks in %.1fs", launch.job_id, spec.world_size,
                        time.perf_counter() - started)
            return Finished(_checkpoint_bytes(ended, channel, launch.job_id))

    def _staged(self, spec: TaskSpec, launch: Launch, frame: DataFrame) -> tuple[TaskSpec, DataFrame]:
        """The job, its rows staged first where it would read them through the rows'
        shuffle and they may be (see :meth:`KeptIngest.stage`). A staging job that fails
        (files it cannot write: another user's executors, a full disk) leaves the rows to
        the shuffle; one whose failure a relaunch cannot fix either (see :func:`_raise_lasting`)
        fails the fit: the shuffle would meet it again.

        Raises:
            SparkTorchError: That failure, explained.
        """
        def run(job: DataFrame) -> pa.Table:
            self.on_phase(STAGING)
            return cast(pa.Table, self._run_job(job, launch, 0))  # no slots to lose, none to grow back to

        if frame is not self.rows.training_frame:
            return spec, frame
        try:
            staged = self.rows.stage(run)
        except Exception as error:
            if not (is_spark_error(error) or isinstance(error, OSError)):
                raise
            if is_spark_error(error):
                _raise_lasting(error)
            self.rows.unstage(f"staging them failed ({str(error).strip().splitlines()[0][:300]})")
            self.on_phase(None)  # the training job reads them through the shuffle
            return spec, frame
        if staged:
            self.on_phase(None)
        return (self.rows.spec(spec), self.rows.frame) if staged else (spec, frame)

    def _collect(self, spec: TaskSpec, launch: Launch, frame: DataFrame,
                 grow: GrowWatch | None = None) -> pa.Table | SlotsLost | GrowBack:
        """Runs the job in a thread so the driver can tick, turn Ctrl-C into a cancel, and
        cancel a job whose ranks can no longer all have a slot (an executor was lost), which
        Spark would otherwise retry for minutes waiting for every slot, or a shrunk job
        whose slots came back, once it wrote its next checkpoint (``grow``).

        Returns:
            The job's result table, or why the job was cancelled: the cluster's task slots
            fell below its ranks, or those of ``numWorkers`` ranks are back and a
            checkpoint to grow at is written.
        """
        with _shipped(self.spark, spec) as shipped:
            job = frame.mapInArrow(train_task(shipped, launch), RESULT_SCHEMA, barrier=True)
            return self._run_job(job, launch, spec.world_size, grow)

    def _run_job(self, job: DataFrame, launch: Launch, ranks: int,
                 grow: GrowWatch | None = None) -> pa.Table | SlotsLost | GrowBack:
        group = f"spark_torch_est-{launch.job_id}"
        control = _JobControl(self.spark, group)
        result: dict = {}

        def collect() -> None:
            control.enter()
            try:
                result["table"] = collect_arrow(job)
            except BaseException as error:  # noqa: B036 - handed to the calling thread
                result["error"] = error

        thread = threading.Thread(target=collect, name=group, daemon=True)
        thread.start()
        checked, watch = time.monotonic(), task_slots(self.spark) is not None  # None: Spark Connect
        try:
            while thread.is_alive():
                thread.join(0.2)
                if self._stop.is_set():
                    raise KeyboardInterrupt
                if watch and thread.is_alive() and time.monotonic() - checked >= 1.0:
                    checked = time.monotonic()
                    slots = task_slots(self.spark)
                    cancelled: SlotsLost | GrowBack | None = None
                    if slots is not None and slots < ranks:
                        cancelled = SlotsLost(slots, ranks)
                    elif grow is not None and slots is not None and (reason := grow.ready(slots)) is not None:
                        cancelled = GrowBack(ranks, reason)
                    if cancelled is not None:
                        logger.warning("cancelling training job %s: %s", launch.job_id, cancelled)
                        control.cancel()
                        thread.join(60)
                        if "table" in result:  # it finished as it was cancelled: its result stands
                            return result["table"]
                        return cancelled
        except KeyboardInterrupt:
            logger.warning("interrupted: cancelling the training job")
            control.cancel()
            thread.join(60)
            raise
        if "error" in result:
            raise result["error"]
        return result["table"]


def _raise_lasting(error: Exception) -> None:
    """Raises the failure of a Spark job other than the training job, explained, when a
    relaunch cannot fix it (see :func:`explain_job_failure`: the DataFrame's own error, a
    file Spark cannot read, the executors' Python without this package); returns for any
    other. No rank runs in such a job: no report in its text is trusted (a secret of its own)."""
    explained = explain_job_failure(str(error), [], secrets.token_bytes(32))
    if not (isinstance(explained, TrainingFailedError) and explained.retryable):
        raise explained from None


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
