"""[driver] How each training job of a fit ended, and what the launcher does next.

Each job ends in one outcome: :class:`Finished`, :class:`SlotsLost` (an executor was lost
while the job ran), :class:`GrowBack` (a job on fewer than ``numWorkers`` ranks ended to
grow back), :class:`RowsMissing` (a part the executors kept between fits is gone),
:class:`StoreUnreachable` (the executors could not reach the driver's rendezvous store) or
:class:`Failed` with its error. Two policies turn an outcome into a :class:`Decision` and
log why: :class:`FailurePolicy` for jobs that ended early, :class:`ScalingPolicy` for the
ranks each job gets and for growing back. The launcher (:class:`~spark_torch_est.cluster.
launcher.Launcher`) runs the jobs and applies the decisions; no exception carries one.

Every relaunch is bounded, and counted in :class:`Launches`: those after failures a
relaunch can fix against ``maxRetries``, the others (a lost executor, growing back, kept
rows gone, rerouting) against :data:`MAX_UNCOUNTED_RELAUNCHES` per fit.
"""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, field

from pyspark.sql import SparkSession

from spark_torch_est.checkpoints.storage import CheckpointDir
from spark_torch_est.core.jvm import task_slots
from spark_torch_est.core.running import fit_logger
from spark_torch_est.core.spec import TaskSpec
from spark_torch_est.errors import InvalidInputError, SparkTorchError, TrainingFailedError

__all__ = [
    "MAX_UNCOUNTED_RELAUNCHES", "Finished", "SlotsLost", "GrowBack", "RowsMissing", "StoreUnreachable", "Failed",
    "Outcome", "Action", "Decision", "Launches", "FailurePolicy", "ScalingPolicy", "wait_for_slots",
]

logger = fit_logger()

#: Relaunches that ``maxRetries`` does not count, in a row without progress (a relaunch
#: that resumes from a newer checkpoint of the fit starts the count again): after a lost
#: executor, to grow back to ``numWorkers`` ranks, to read kept rows that are gone through
#: Spark, to rendezvous through Spark's allGather. A lost executor costs one, and one more
#: when the run grows back once its slots return.
MAX_UNCOUNTED_RELAUNCHES = 10

LOCAL_MASTER = re.compile(r"^local(\[[^\]]*\])?$")


# ------------------------------------------------------------------------ outcomes


@dataclass(frozen=True)
class Finished:
    """The job trained to its target; ``checkpoint`` is rank 0's final checkpoint."""

    checkpoint: bytes = field(repr=False)

    def __str__(self) -> str:
        return "finished"


@dataclass(frozen=True)
class SlotsLost:
    """The cluster's task slots fell below the job's ranks (an executor was lost): the
    launcher's watch cancelled the job, or it failed (``error``) as the executor went."""

    slots: int
    ranks: int
    error: SparkTorchError | None = None

    def __str__(self) -> str:
        cause = f" ({_said(self.error)})" if self.error is not None else ""
        return f"the cluster's task slots fell to {self.slots} while the job needed {self.ranks}{cause}"


@dataclass(frozen=True)
class GrowBack:
    """A job on fewer than ``numWorkers`` ranks was cancelled to grow back (``reason``)."""

    ranks: int
    reason: str

    def __str__(self) -> str:
        return f"cancelled on {self.ranks} ranks to grow back: {self.reason}"


@dataclass(frozen=True)
class RowsMissing:
    """A rank found a part of the rows the executors kept between fits gone."""

    error: SparkTorchError

    def __str__(self) -> str:
        return _said(self.error)


@dataclass(frozen=True)
class StoreUnreachable:
    """The executors could not reach the driver's rendezvous store."""

    error: SparkTorchError

    def __str__(self) -> str:
        return f"the executors cannot reach the driver's rendezvous store ({_said(self.error)})"


@dataclass(frozen=True)
class Failed:
    """The job failed with ``error`` (a rank's error, Spark's, or the driver's own)."""

    error: SparkTorchError

    def __str__(self) -> str:
        return f"failed: {_said(self.error)}"


def _said(error: SparkTorchError) -> str:
    """An error's message, without the remote traceback a TrainingFailedError prints."""
    return error.message if isinstance(error, TrainingFailedError) else str(error)


Outcome = Finished | SlotsLost | GrowBack | RowsMissing | StoreUnreachable | Failed


# ----------------------------------------------------------------------- decisions


class Action(enum.Enum):
    """What the launcher does after a job."""

    FINISH = "finish"      # return the job's checkpoint
    RELAUNCH = "relaunch"  # again, from the newest checkpoint this fit wrote
    REREAD = "reread"      # the same job again, reading the rows through Spark
    REROUTE = "reroute"    # the same job again, rendezvousing through Spark's allGather
    RESIZE = "resize"      # again on numWorkers ranks, from the checkpoint the run grows at
    RAISE = "raise"        # fail the fit with ``Decision.error``


@dataclass(frozen=True)
class Decision:
    """A policy's answer to an outcome.

    Attributes:
        action: What the launcher does.
        reason: Why, as logged.
        counted: The relaunch counts against ``maxRetries`` (else against
            :data:`MAX_UNCOUNTED_RELAUNCHES`).
        error: What RAISE raises.
    """

    action: Action
    reason: str
    counted: bool = False
    error: SparkTorchError | None = None


class Launches:
    """The jobs of one fit, how each ended, and the two bounds on relaunching.

    Args:
        max_retries: Relaunches allowed after failures a relaunch can fix (``maxRetries``).
        max_uncounted: Relaunches allowed for other reasons (see :data:`MAX_UNCOUNTED_RELAUNCHES`).
    """

    def __init__(self, max_retries: int, max_uncounted: int = MAX_UNCOUNTED_RELAUNCHES) -> None:
        self.max_retries = max_retries
        self.max_uncounted = max_uncounted
        self.counted = 0
        self.uncounted = 0
        self.ended: list[Outcome] = []

    def end(self, outcome: Outcome) -> None:
        """Records how the latest job ended."""
        self.ended.append(outcome)

    def relaunch(self, counted: bool, reason: str, action: Action = Action.RELAUNCH) -> Decision:
        """``action`` within its bound (logged with ``reason``), else RAISE with what happened."""
        if counted and self.counted >= self.max_retries:
            logger.warning("not relaunching: maxRetries=%d relaunches used (%s)", self.max_retries, reason)
            return Decision(Action.RAISE, reason, error=self._exhausted(f"maxRetries={self.max_retries} relaunches "
                                                                        "after failures are used"))
        if not counted and self.uncounted >= self.max_uncounted:
            logger.warning("not relaunching: %d relaunches that maxRetries does not count are used (%s)",
                           self.max_uncounted, reason)
            return Decision(Action.RAISE, reason, error=self._exhausted(
                f"the {self.max_uncounted} relaunches a fit makes beyond maxRetries (lost executors, growing back, "
                "kept rows gone, rerouting) are used"))
        if counted:
            self.counted += 1
            logger.warning("relaunching training (%d of %d) %s", self.counted, self.max_retries, reason)
        else:
            self.uncounted += 1
            logger.warning("relaunching training (%d of %d not counted in maxRetries) %s", self.uncounted,
                           self.max_uncounted, reason)
        return Decision(action, reason, counted=counted)

    def progressed(self) -> None:
        """The next job resumes from a newer checkpoint than the last relaunch did: the bound
        on uncounted relaunches counts those between two points of progress, so a long
        elastic run that loses and regains executors now and then keeps training."""
        self.uncounted = 0

    def summary(self) -> str:
        """What each job of the fit ended in, in order."""
        ends = "; ".join(f"job {number}: {outcome}" for number, outcome in enumerate(self.ended, 1))
        return (f"the fit launched its training job {len(self.ended)} times ({self.counted} relaunches counted in "
                f"maxRetries, {self.uncounted} not): {ends}")

    def _exhausted(self, bound: str) -> TrainingFailedError:
        last = self.ended[-1] if self.ended else None
        cause = last.error if isinstance(last, (Failed, SlotsLost, RowsMissing, StoreUnreachable)) else None
        return TrainingFailedError(
            f"{bound}; {self.summary()}", rank=getattr(cause, "rank", None), stage=getattr(cause, "stage", None),
            hook=getattr(cause, "hook", None), remote_traceback=getattr(cause, "remote_traceback", None),
            retryable=True)


class FailurePolicy:
    """Decides what follows a job that ended early, and logs why: RELAUNCH after a
    failure a relaunch can fix (counted in ``maxRetries``) or a lost executor (not
    counted), REREAD when kept rows are gone, REROUTE when the store is unreachable,
    RAISE otherwise or once the bound is reached.

    Args:
        launches: The fit's launches, which hold the bounds.
    """

    def __init__(self, launches: Launches) -> None:
        self.launches = launches

    def decide(self, outcome: SlotsLost | RowsMissing | StoreUnreachable | Failed) -> Decision:
        """The decision for ``outcome``."""
        if isinstance(outcome, SlotsLost):
            return self.launches.relaunch(False, f"after an executor was lost: {outcome}")
        if isinstance(outcome, RowsMissing):
            return self.launches.relaunch(False, f"after {outcome}: reading it through Spark again", Action.REREAD)
        if isinstance(outcome, StoreUnreachable):
            return self.launches.relaunch(False, f"rendezvousing through Spark's allGather instead: {outcome}",
                                          Action.REROUTE)
        error = outcome.error
        if not (isinstance(error, TrainingFailedError) and error.retryable):
            logger.info("not relaunching: the failure is not one a relaunch can fix (%s)", type(error).__name__)
            return Decision(Action.RAISE, f"{type(error).__name__} is not one a relaunch can fix", error=error)
        decision = self.launches.relaunch(True, f"after a system failure: {error.message}")
        if decision.action is Action.RAISE:  # the job's own error, with what the fit's jobs ended in
            if len(self.launches.ended) > 1:
                error.message += f"; {self.launches.summary()}"
                error.args = (error.message,)
            return Decision(Action.RAISE, decision.reason, error=error)
        return decision


class ScalingPolicy:
    """How many ranks each job of a fit gets, and when a job on fewer than ``numWorkers``
    ranks ends to grow back (at most once per ``slotWaitTimeout``), logging why.

    Args:
        spark: The session.
        wanted: ``numWorkers``.
        min_workers: ``minWorkers``; None: every job has ``wanted`` ranks.
        slot_wait_s: ``slotWaitTimeout``.
        launches: The fit's launches, which hold the bounds.
    """

    def __init__(self, spark: SparkSession, wanted: int, min_workers: int | None, slot_wait_s: float,
                 launches: Launches) -> None:
        self.spark, self.wanted, self.min_workers, self.slot_wait_s = spark, wanted, min_workers, slot_wait_s
        self.launches = launches
        self.grown_at = -float("inf")  # when this fit last grew back (monotonic seconds)

    def ranks(self) -> int:
        """The ranks of the next job, after a bounded wait for the slots (see :func:`wait_for_slots`)."""
        return wait_for_slots(self.spark, self.wanted, self.slot_wait_s, self.min_workers)

    def grow_watch(self, job: TaskSpec) -> GrowWatch | None:
        """What watches a shrunk job for the slots to come back: only with periodic
        checkpoints to grow at, and at most once per ``slotWaitTimeout``."""
        if job.world_size >= self.wanted or not job.checkpoint_dir or job.checkpoint_every is None:
            return None
        if time.monotonic() - self.grown_at < self.slot_wait_s:
            return None
        return GrowWatch(self.wanted, CheckpointDir(job.checkpoint_dir, run_id=job.run_id))

    def decide(self, outcome: GrowBack) -> Decision:
        """RESIZE to ``numWorkers`` ranks (not counted in ``maxRetries``), within the bound."""
        decision = self.launches.relaunch(False, f"growing the run from {outcome.ranks} to numWorkers={self.wanted} "
                                                 f"ranks: {outcome.reason}", Action.RESIZE)
        if decision.action is Action.RESIZE:
            self.grown_at = time.monotonic()
        return decision


class GrowWatch:
    """Watches a job running on fewer than ``numWorkers`` ranks: once the cluster offers
    ``wanted`` slots again, the next checkpoint the run writes is where it grows.

    Args:
        wanted: ``numWorkers``.
        checkpoints: The run's checkpointDir.
    """

    def __init__(self, wanted: int, checkpoints: CheckpointDir) -> None:
        self.wanted, self.checkpoints = wanted, checkpoints
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
        local = bool(LOCAL_MASTER.match(master))  # local mode never gains slots: do not wait
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
