"""[driver] The barrier job: slots, rendezvous store, launch, cancel, errors, relaunches."""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

from pyspark.sql import DataFrame, SparkSession

from spark_torch_est.channel import ChannelServer
from spark_torch_est.checkpoint import Checkpoint
from spark_torch_est.errors import InvalidInputError, SparkTorchError, TrainingFailedError
from spark_torch_est.failure import SYSTEM, UNREACHABLE, Failure
from spark_torch_est.spec import TaskSpec
from spark_torch_est.storage import CheckpointDir
from spark_torch_est.worker import DELIVERED, RESULT_SCHEMA, failure_key, train_task

__all__ = ["Launcher", "explain_job_failure", "task_slots", "wait_for_slots"]

logger = logging.getLogger(__name__)

_RESULT_TOO_LARGE = re.compile(r"bigger than spark\.driver\.maxResultSize \(([^)]*)\)")
_MISSING_MODULE = re.compile(r"No module named '([^']+)'")
_BARRIER_UNSUPPORTED = re.compile(r"Barrier execution mode does not (?:allow|support)[^\n]*")


def task_slots(spark: SparkSession) -> int | None:
    """Tasks the cluster can run at once with the default resource profile, or None when
    Spark cannot say (Spark Connect)."""
    try:
        jsc = spark.sparkContext._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # Connect sessions have no SparkContext; Spark's own barrier check remains
        return None


def wait_for_slots(spark: SparkSession, needed: int, timeout_s: float) -> None:
    """Waits (bounded) for executors to offer ``needed`` slots at once.

    Raises:
        InvalidInputError: The slots did not appear within ``timeout_s``; says how many did.
    """
    deadline = time.monotonic() + timeout_s
    slots = task_slots(spark)
    while slots is not None and slots < needed:
        if time.monotonic() >= deadline:
            conf = spark.sparkContext.getConf()
            raise InvalidInputError(
                f"numWorkers={needed} needs {needed} task slots at once, but the cluster offers {slots} "
                f"(master={conf.get('spark.master', '?')}, spark.task.cpus={conf.get('spark.task.cpus', '1')}, "
                f"waited {timeout_s:.0f}s, see slotWaitTimeout); lower numWorkers or add executor cores"
            )
        logger.info("waiting for task slots: %d of %d available", slots, needed)
        time.sleep(0.5)  # polling the scheduler, not synchronizing
        slots = task_slots(spark)


class _StoreUnreachable(TrainingFailedError):
    """Executors could not reach the driver's store; the launcher falls back to allGather."""


class _DriverStore:
    """The rendezvous TCPStore, bound to the driver host only (never to all interfaces)."""

    def __init__(self, host: str, timeout_s: float) -> None:
        import torch.distributed as dist

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.bind((host, 0))
        self._socket.listen(256)
        self.host = host
        self.port = self._socket.getsockname()[1]
        self.store = dist.TCPStore(host, self.port, None, True, timedelta(seconds=timeout_s),
                                   wait_for_workers=False, master_listen_fd=self._socket.fileno())
        self._socket.detach()  # the store owns the descriptor now and closes it

    def failures(self, job_id: str, world_size: int) -> list[Failure]:
        """Failures the ranks of ``job_id`` reported, in rank order (they write through a
        ``PrefixStore(job_id)``, which joins prefix and key with ``/``)."""
        keys = [f"{job_id}/{failure_key(rank)}" for rank in range(world_size)]
        return [Failure.from_json(self.store.get(k)) for k in keys if self.store.check([k])]

    def close(self) -> None:
        del self.store


def _driver_host(spark: SparkSession) -> str | None:
    try:
        return spark.sparkContext.getConf().get("spark.driver.host")
    except Exception:  # Spark Connect: the client is not the driver
        return None


class Launcher:
    """Runs barrier training jobs for one fit, relaunching from checkpoints on failures
    a relaunch can fix.

    Args:
        spark: The session of the training DataFrame.
        frame: The prepared training DataFrame (see :func:`frames.training_frame`).
        max_retries: Relaunches allowed after retryable failures.
        slot_wait_s: Longest wait for free task slots before each launch.
        on_message: Receives the ranks' progress and log messages (driver threads).
    """

    _store_unreachable: set[str] = set()  # driver hosts executors could not reach

    def __init__(self, spark: SparkSession, frame: DataFrame, max_retries: int, slot_wait_s: float,
                 on_message: Callable[[dict], None] | None = None) -> None:
        self.spark = spark
        self.frame = frame
        self.max_retries = max_retries
        self.slot_wait_s = slot_wait_s
        self.on_message = on_message or (lambda message: None)

    def run(self, spec: TaskSpec) -> bytes:
        """Trains; returns rank 0's checkpoint bytes.

        Raises:
            SparkTorchError: The job failed for good (see :mod:`spark_torch_est.failure`).
            KeyboardInterrupt: The fit was interrupted; the job was cancelled first.
        """
        retries = 0
        while True:
            spec = dataclasses.replace(spec, job_id=f"ste-{uuid.uuid4().hex[:12]}")
            wait_for_slots(self.spark, spec.world_size, self.slot_wait_s)
            try:
                return self._launch(spec)
            except _StoreUnreachable:
                logger.warning("executors cannot reach the driver's store; using Spark's allGather")
                continue
            except TrainingFailedError as error:
                if not error.retryable or retries >= self.max_retries:
                    raise
                retries += 1
                spec = self._relaunch_spec(spec)
                resumed = Checkpoint.from_bytes(spec.resume).progress if spec.resume else "the start"
                logger.warning("relaunching training (%d of %d) from %s after: %s", retries, self.max_retries,
                               resumed, error.message)

    def _relaunch_spec(self, spec: TaskSpec) -> TaskSpec:
        """The same target, resumed from the newest checkpoint of this run in checkpointDir
        when it is newer than the one this fit started from."""
        if spec.checkpoint_dir is None:
            return spec
        newest = CheckpointDir(spec.checkpoint_dir).latest()
        if newest is None:
            return spec
        candidate = Checkpoint.from_bytes(newest)
        started = Checkpoint.from_bytes(spec.resume).progress.global_step if spec.resume else -1
        if candidate.meta.get("run_id") == spec.run_id and candidate.progress.global_step > started:
            return dataclasses.replace(spec, resume=newest)
        return spec

    @contextmanager
    def _driver_services(self) -> Iterator[tuple[_DriverStore | None, ChannelServer | None]]:
        """The rendezvous store and the progress channel, both bound to the driver host."""
        host = _driver_host(self.spark)
        store = channel = None
        if host is not None and host not in self._store_unreachable:
            try:
                store = _DriverStore(host, timeout_s=60.0)
            except OSError as error:
                logger.warning("cannot open a rendezvous store on %s (%s); using Spark's allGather", host, error)
        if host is not None:
            try:
                channel = ChannelServer(host, self.on_message)
            except OSError as error:
                logger.warning("cannot open the progress channel on %s (%s); no live progress", host, error)
        try:
            yield store, channel
        finally:
            if channel is not None:
                channel.close()
            if store is not None:
                store.close()

    def _launch(self, spec: TaskSpec) -> bytes:
        with self._driver_services() as (store, channel):
            spec = dataclasses.replace(
                spec,
                store_host=store.host if store is not None else None,
                store_port=store.port if store is not None else None,
                progress_address=channel.address if channel is not None else None,
                progress_secret=channel.secret if channel is not None else None,
            )
            started = time.perf_counter()
            try:
                table = self._collect(spec)
            except SparkTorchError:
                raise
            except Exception as error:
                raise self._explain(error, spec, store) from None
            logger.info("training job %s finished in %.1fs", spec.job_id, time.perf_counter() - started)
            return _checkpoint_bytes(table, channel, spec.job_id)

    def _collect(self, spec: TaskSpec):
        """Runs the job in a thread so the driver can tick and turn Ctrl-C into a cancel."""
        job = self.frame.mapInArrow(train_task(spec), RESULT_SCHEMA, barrier=True)
        group = f"spark_torch_est-{spec.job_id}"
        control = _JobControl(self.spark, group)
        outcome: dict = {}

        def collect() -> None:
            control.enter()
            try:
                outcome["table"] = job.toArrow()
            except BaseException as error:  # noqa: B036 - handed to the calling thread
                outcome["error"] = error

        thread = threading.Thread(target=collect, name=group, daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                thread.join(0.2)
        except KeyboardInterrupt:
            logger.warning("interrupted: cancelling the training job")
            control.cancel()
            thread.join(60)
            raise
        if "error" in outcome:
            raise outcome["error"]
        return outcome["table"]

    def _explain(self, error: Exception, spec: TaskSpec, store: _DriverStore | None) -> SparkTorchError:
        reported = store.failures(spec.job_id, spec.world_size) if store is not None else []
        explained = explain_job_failure(str(error), reported)
        if isinstance(explained, _StoreUnreachable):
            self._store_unreachable.add(spec.store_host or "")
        return explained


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


def explain_job_failure(text: str, reported: list[Failure]) -> SparkTorchError:
    """Maps a failed job to the most specific error: a rank's own report (a user error
    before the "connection closed" its peers saw), else what Spark's error text shows.

    Args:
        text: The exception text of the failed job.
        reported: Failures the ranks left in the driver's store.
    """
    found = Failure.find(text)
    candidates = reported + ([found] if found is not None else [])
    if candidates:
        root = next((f for f in candidates if f.kind != SYSTEM), candidates[0])
        if root.kind == UNREACHABLE:
            return _StoreUnreachable(root.message)
        return root.to_error()
    too_large = _RESULT_TOO_LARGE.search(text)
    if too_large:
        return TrainingFailedError(
            f"the checkpoint is bigger than spark.driver.maxResultSize ({too_large.group(1)}); raise it, "
            "e.g. --conf spark.driver.maxResultSize=4g"
        )
    missing = _MISSING_MODULE.search(text)
    if missing:
        return TrainingFailedError(
            f"the executors' Python cannot import {missing.group(1)!r}: point PYSPARK_PYTHON at an environment "
            "with torch and spark_torch_est, or ship the package (--py-files / --archives)",
            remote_traceback=text[-4000:],
        )
    unsupported = _BARRIER_UNSUPPORTED.search(text)
    if unsupported:  # e.g. dynamic allocation, or more slots than the cluster has
        return InvalidInputError(f"Spark cannot run the barrier job: {unsupported.group(0)}")
    return TrainingFailedError(f"the training job failed: {_first_line(text)}",
                               remote_traceback=text[-4000:], retryable=True)


def _first_line(text: str) -> str:
    """The most telling line of a Spark error: the first exception that is not the
    generic "Job aborted" wrapper."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    specific = [line for line in errors if "Job aborted" not in line]
    return (specific or errors or lines or ["(no message)"])[0][:500]


class _JobControl:
    """A job group (classic Spark) or tag (Spark Connect) that cancels just this fit's job."""

    def __init__(self, spark: SparkSession, name: str) -> None:
        self.spark = spark
        self.name = name
        try:
            self.context = spark.sparkContext
        except Exception:  # Spark Connect
            self.context = None

    def enter(self) -> None:
        """Marks jobs started by the calling thread."""
        if self.context is not None:
            self.context.setJobGroup(self.name, "spark_torch_est training", interruptOnCancel=True)
        else:
            self.spark.addTag(self.name)

    def cancel(self) -> None:
        """Cancels every job of the group."""
        if self.context is not None:
            self.context.cancelJobGroup(self.name)
        else:
            self.spark.interruptTag(self.name)
