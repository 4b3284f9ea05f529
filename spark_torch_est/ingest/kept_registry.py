"""[driver] Fit many, ingest once: the kept registry, the driver's record (in its memory, for
one application) of which training frames' rows the executors keep between fits, and the
key that says what rows they are. It holds no rows itself.

The first fit on a DataFrame that goes through Spark keeps each rank's part on its
executor's local disk (see :mod:`spark_torch_est.ingest.kept`). A later fit in the same session
whose training frame has the same key runs a job of one row per rank instead of Spark's
scan and shuffle; its ranks take the parts they kept. The key names the application and
covers everything the rows depend on:

- the training frame's optimized plan, canonicalized (the columns and their conversions,
  filters, joins, ``numWorkers``' repartition), and the session's ``spark.sql.*`` settings;
- each leaf of the plan: a cache by its identity (a cache unpersisted and made again is
  another one); a file scan by its files' paths, sizes and modification times (a local
  file also by its change time and inode); a range by its bounds (in the plan).

A plan with anything the key cannot describe is never reused: user-defined functions
(their code is not in the plan), local or RDD data, other data sources (Delta, JDBC, ...),
streaming. The rows of a cache that was unpersisted are released about a second later:
removed at once in local mode (the executor is the driver's), by the executors of the
session's next job elsewhere.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pyarrow as pa
from pyspark import SparkContext
from pyspark.sql import DataFrame, SparkSession

from spark_torch_est.core import jvm
from spark_torch_est.core.running import fit_logger
from spark_torch_est.core.spec import FileSource, KeptPlan, StagedRows, TaskSpec
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.ingest.kept import KEPT_FOLDER, MISSING
from spark_torch_est.ingest.staged import STAGED_MISSING, stage

__all__ = ["KeptIngest", "frame_key"]

_REMOVALS = 3  # tries at removing the staged rows' folder (see KeptIngest.close)

logger = fit_logger()


@dataclass
class _Registry:
    """The keys whose rows the executors of one application keep, each with the caches
    its rows came from (to release it when one is unpersisted)."""

    app_id: str = ""
    keys: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Released keys whose rows the executors of the next job remove (from disk and memory).
    released: set[str] = field(default_factory=set)
    watcher: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


#: One application at a time: a new SparkContext (after ``stop()``) starts with nothing kept.
_KEPT = _Registry()
#: How often the driver looks whether a kept DataFrame's cache was unpersisted.
WATCH_S = 1.0


def frame_key(frame: DataFrame) -> tuple[str, tuple[int, ...]] | None:
    """The key of the training frame's rows and the caches they come from, or None when
    the plan holds something the key cannot describe (see the module's docstring)."""
    described = jvm.describe_plan(frame)  # None under Spark Connect too: never reused
    if described is None:
        return None
    text, leaves, caches = described
    spark = frame.sparkSession
    settings = sorted(jvm.sql_settings(spark).items())
    key = json.dumps([spark.sparkContext.applicationId, text, leaves, settings, frame.schema.json()], default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:32], tuple(caches)


class KeptIngest:
    """One fit's rows: the training frame through Spark, keeping what each rank receives,
    or the parts the executors kept of it, or the rows a staging job wrote out for the
    ranks instead of the frame's shuffle (see :mod:`spark_torch_est.ingest.staged`); the
    launcher asks before each job.

    Args:
        spark: The session.
        frame: The training frame (see :func:`frames.training_frame`).
        source: The Parquet files the ranks read themselves (nothing is kept then: they
            are the rows, read at pyarrow's speed), or None.
        workers: The ranks (``numWorkers``).
        limit_mb: ``keepIngestedMB``; 0 keeps nothing.
        staging: The training columns in the DataFrame's own partitions, when the frame
            shuffles them into as many logical partitions as ranks (see
            :func:`frames.staging_frame`); None: the frame is read as it is.
    """

    def __init__(self, spark: SparkSession, frame: DataFrame, source: FileSource | None, workers: int,
                 limit_mb: float, staging: DataFrame | None = None) -> None:
        self.spark = spark
        self.training_frame = frame
        self.workers = workers
        self._plan: KeptPlan | None = None
        self._planned = source is not None or limit_mb <= 0  # nothing is kept: no plan to make
        self._limit_mb = limit_mb
        self._caches: tuple[int, ...] = ()
        self._staging = staging
        self._staged: StagedRows | None = None
        self._folder: str | None = None  # the staged files' folder, removed by close()

    @property
    def plan(self) -> KeptPlan | None:
        """The next job's plan for kept rows (None: nothing is kept), made when the launcher
        first asks, after the wait for task slots: describing a cached frame's plan can run
        a Spark job (it materializes the cache), which a fit refused for its slots never runs.

        Raises:
            Exception: Spark's error when that job failed (see ``jvm.describe_plan``);
                nothing is kept then.
        """
        if not self._planned:
            self._planned = True
            self._plan = self._first_plan()
        return self._plan

    @plan.setter
    def plan(self, plan: KeptPlan | None) -> None:
        self._planned, self._plan = True, plan

    def _first_plan(self) -> KeptPlan | None:
        described = frame_key(self.training_frame)  # None under Spark Connect, whose client has no JVM
        if described is None:
            logger.info("the rows of this DataFrame are not kept between fits: its plan holds something the key "
                        "cannot describe (a user-defined function, local or RDD data, another data source)")
            return None
        key, self._caches = described
        with _KEPT.lock:
            _release_unpersisted(self.spark.sparkContext)
            mode = "read" if key in _KEPT.keys else "write"
            released, _KEPT.released = tuple(sorted(_KEPT.released)), set()
        if mode == "read":
            logger.info("the executors kept this DataFrame's rows from an earlier fit (%s): no scan, no shuffle",
                        key[:12])
        return KeptPlan(key=key, mode=mode, limit=int(self._limit_mb * (1 << 20)), drop=released)

    @property
    def frame(self) -> DataFrame:
        """What the next job reads: the training frame, or one row per rank when the ranks
        take the parts they kept or read the staged rows."""
        if (self.plan is not None and self.plan.mode == "read") or self._staged is not None:
            return self.spark.range(0, self.workers, 1, self.workers)
        return self.training_frame

    def spec(self, spec: TaskSpec) -> TaskSpec:
        """``spec`` with the next job's plan for kept rows and the staged rows."""
        return replace(spec, kept=self.plan, staged=self._staged)

    def stage(self, run: Callable[[DataFrame], pa.Table]) -> bool:
        """Writes the rows out for the next job's ranks through the job ``run`` runs, where
        they would come through the frame's shuffle and every executor runs on the driver's
        host (once a fit); whether the next job reads them staged.

        Raises:
            Exception: The staging job's error (the DataFrame's own, as the shuffle's would be).
        """
        if self._staged is not None:
            return True
        if self._staging is None or (self.plan is not None and self.plan.mode == "read"):
            return False
        if not jvm.one_host(self.spark):
            logger.info("the rows come through Spark's shuffle: the executors run on more than one host")
            self._staging = None
            return False
        if self._folder is None:  # else a staging job that failed wrote there, renaming only whole files
            context = self.spark.sparkContext
            root = jvm.driver_files_dir(context) or next(iter(jvm.local_dirs(context)), None)  # Spark removes the 1st
            self._folder = tempfile.mkdtemp(prefix="spark_torch_est-staged-", dir=root)
        started = time.perf_counter()
        self._staged = stage(self._staging, self.workers, self._folder, run)
        logger.info("staged %d rows of %d partitions in %.1fs: the ranks read them without a shuffle",
                    sum(rows for _, rows in self._staged.parts), len(self._staged.parts),
                    time.perf_counter() - started)
        return True

    def unstage(self, why: str) -> None:
        """The rows come through the frame's shuffle from the next job on, as ``why`` says."""
        logger.warning("the rows come through Spark's shuffle: %s", why)
        self.close()
        self._staging = None

    def close(self) -> None:
        """Removes the staged rows (the fit ended). Tasks of a staging job cancelled a
        moment ago may still rename a file into the folder: it is removed again, a few
        times at most."""
        self._staged, folder, self._folder = None, self._folder, None
        if folder is None:
            return
        for _ in range(_REMOVALS):
            shutil.rmtree(folder, ignore_errors=True)
            if not os.path.exists(folder):
                break
            time.sleep(0.5)

    def missing(self, error: Exception) -> bool:
        """Whether ``error`` is the ranks finding a kept part gone, or staged rows they cannot
        read (then :meth:`read_again`)."""
        if not isinstance(error, InvalidInputError):
            return False
        kept = self.plan is not None and self.plan.mode == "read" and MISSING in str(error)
        return kept or (self._staged is not None and STAGED_MISSING in str(error))

    def read_again(self) -> None:
        """The next job reads the training frame through Spark, keeping its rows anew (a
        kept part was gone, or the staged rows were not readable: through the shuffle,
        see :meth:`missing`)."""
        if self.plan is not None and self.plan.mode == "read":
            with _KEPT.lock:
                _KEPT.keys.pop(self.plan.key, None)
            self.plan = replace(self.plan, mode="write", drop=())
            return
        if self._staged is not None:
            self.unstage("the ranks could not read the staged rows")

    def relaunching(self) -> None:
        """A job failed and is launched again: if it was keeping the rows, the ranks that
        got through their ingest kept their parts, so the relaunch takes them (all of them
        when the failure came after the ingest; else :meth:`read_again`)."""
        if self.plan is not None:
            if self.plan.mode == "write":
                logger.info("the relaunch takes the rows the failed job's ranks kept, if they all got through")
            self.plan = replace(self.plan, mode="read", drop=())

    def succeeded(self, job: TaskSpec) -> None:
        """Records the rows as kept once a job that kept or read them succeeded (not a job
        shrunk to fewer ranks, which keeps nothing)."""
        if job.kept is None:
            return
        with _KEPT.lock:
            _KEPT.keys[job.kept.key] = self._caches
            if self._caches and _KEPT.watcher is None:
                _KEPT.watcher = threading.Thread(target=_watch, args=(self.spark.sparkContext,),
                                                 name="spark_torch_est-kept-watch", daemon=True)
                _KEPT.watcher.start()


def _release_unpersisted(context: SparkContext) -> None:
    """Forgets the keys of another application (a stopped session's executors removed
    their local directories) and releases those whose caches were unpersisted: removed
    here at once when the executor is the driver's own (local mode), by the next job's
    executors elsewhere. Callers hold the registry's lock."""
    if _KEPT.app_id != context.applicationId:
        _KEPT.app_id, _KEPT.keys, _KEPT.released = context.applicationId, {}, set()
        return
    alive = jvm.cache_alive(context)
    gone = [key for key, caches in _KEPT.keys.items() if not all(alive(c) for c in caches)]
    for key in gone:
        del _KEPT.keys[key]
        _KEPT.released.add(key)
        _remove_in_driver(context, key)
        logger.info("released the kept rows %s: their DataFrame was unpersisted", key[:12])


def _remove_in_driver(context: SparkContext, key: str) -> None:
    """Removes the rows kept under ``key`` when the executor runs in the driver (local
    mode): its Python workers' local directory is the block manager's folder under one of
    Spark's local directories (the key names this application, not another's there)."""
    if context.master is None or not re.fullmatch(r"local(\[.*\])?", context.master):
        return
    for root in jvm.local_dirs(context):  # none readable: left to the next job's executors
        for folder in glob.glob(os.path.join(glob.escape(root), "blockmgr-*", KEPT_FOLDER, key)):
            shutil.rmtree(folder, ignore_errors=True)


def _watch(context: SparkContext) -> None:
    """Releases kept rows soon after their DataFrame is unpersisted (every ``WATCH_S``),
    while the application runs and keeps rows of a cache."""
    try:
        while True:
            time.sleep(WATCH_S)
            with _KEPT.lock:
                if SparkContext._active_spark_context is not context or not any(_KEPT.keys.values()):
                    _KEPT.watcher = None
                    return
                _release_unpersisted(context)
    except Exception as error:  # the session stopped under it
        logger.debug("stopped watching kept rows: %s", error)
        with _KEPT.lock:
            _KEPT.watcher = None
