"""[driver] Fit many, ingest once: which training frames' rows the executors keep between
fits, and the key that says what rows they are.

The first fit on a DataFrame that goes through Spark keeps each rank's part on its
executor's local disk (see :mod:`spark_torch_est.kept`). A later fit in the same session
whose training frame has the same key runs a job of one row per rank instead of Spark's
scan and shuffle; its ranks take the parts they kept. The key covers everything the rows
depend on:

- the training frame's optimized plan, canonicalized (the columns and their conversions,
  filters, joins, ``numWorkers``' repartition), and the session's ``spark.sql.*`` settings;
- each leaf of the plan: a cache by its identity (a cache unpersisted and made again is
  another one); a file scan by its files' paths, sizes and modification times (a local
  file also by its change time and inode); a range by its bounds (in the plan).

A plan with anything the key cannot describe is never reused: user-defined functions
(their code is not in the plan), local or RDD data, other data sources (Delta, JDBC, ...),
streaming. Keys of caches that were unpersisted are dropped at the next fit of the
session, and the executors of that fit's job remove their rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, TypeVar

import fsspec
from pyspark.sql import DataFrame, SparkSession

from spark_torch_est.errors import InvalidInputError
from spark_torch_est.files import file_stamp
from spark_torch_est.kept import MISSING
from spark_torch_est.spec import FileSource, KeptPlan, TaskSpec

__all__ = ["KeptIngest", "frame_key"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
#: Plan nodes and expressions whose results the plan's text does not determine.
_OPAQUE = re.compile(r"UDF|UDAF|UDTF|Python|Pandas|Arrow|MapPartitions|MapElements|MapGroups|CoGroup|AppendColumns"
                     r"|SerializeFromObject|DeserializeToObject|ScriptTransformation|Invoke|NewInstance|Aggregator"
                     r"|Uuid|Shuffle|Streaming|CollectMetrics")
_CLASS = re.compile(r'"class":"([\w.$]+)"')
_FILE_INDEXES = ("InMemoryFileIndex", "PrunedInMemoryFileIndex")
#: Files a scan may list for its key to be made (each is looked at on the driver).
_MAX_FILES = 10_000


@dataclass
class _Registry:
    """The keys whose rows the executors of one application keep, each with the caches
    its rows came from (to drop it when one is unpersisted)."""

    app_id: str = ""
    keys: dict[str, tuple[int, ...]] = field(default_factory=dict)


#: One application at a time: a new SparkContext (after ``stop()``) starts with nothing kept.
_KEPT = _Registry()


def frame_key(frame: DataFrame) -> tuple[str, tuple[int, ...]] | None:
    """The key of the training frame's rows and the caches they come from, or None when
    the plan holds something the key cannot describe (see the module's docstring)."""
    try:
        spark = frame.sparkSession
        plan = frame._jdf.queryExecution().optimizedPlan()
        leaves, caches = _leaves(plan, spark)
        if leaves is None:
            return None
        settings = sorted((k, v) for k, v in spark.conf.getAll.items() if k.startswith("spark.sql."))
        text = plan.canonicalized().treeString(True, False, 2 ** 31 - 1, False, False)
    except Exception as error:  # Spark Connect (no JVM), or a plan the walk does not know: never reused
        logger.debug("no key for the training frame: %s", error)
        return None
    described = json.dumps([text, leaves, settings, frame.schema.json()], default=str)
    return hashlib.sha256(described.encode()).hexdigest()[:32], tuple(caches)


def _leaves(plan, spark: SparkSession) -> tuple[list | None, list[int]]:
    """What each leaf of ``plan`` reads, and the cache ids among them; None when a node,
    an expression or a leaf cannot be described."""
    leaves: list = []
    caches: list[int] = []
    stack = [plan]
    while stack:
        node = stack.pop()
        name = node.getClass().getSimpleName()
        children = node.children()
        if children.size() == 0:
            leaf = _leaf(node, name, spark)
            if leaf is None:
                return None, []
            if leaf[0] == "cache":
                caches.append(leaf[1])
            leaves.append(leaf)
            continue
        if _OPAQUE.search(name):
            return None, []
        expressions = node.expressions()
        for i in range(expressions.size()):
            if any(_OPAQUE.search(c.rsplit(".", 1)[-1]) for c in _CLASS.findall(expressions.apply(i).toJSON())):
                return None, []
        stack.extend(children.apply(i) for i in range(children.size()))
    return leaves, caches


def _leaf(node, name: str, spark: SparkSession) -> list | None:
    if name == "InMemoryRelation":  # the cache's rows stay as they are until it is unpersisted
        return ["cache", int(node.cacheBuilder().cachedColumnBuffers().id())]
    if name in ("Range", "OneRowRelation"):  # described by the plan's text
        return [name]
    if name != "LogicalRelation":
        return None
    relation = node.relation()
    if relation.getClass().getSimpleName() != "HadoopFsRelation" \
            or relation.location().getClass().getSimpleName() not in _FILE_INDEXES:
        return None
    files = list(relation.location().inputFiles())
    if len(files) > _MAX_FILES:
        return None
    return ["files", relation.fileFormat().toString(), str(relation.options()), relation.schema().json(),
            sorted(_stamp(path, spark) for path in files)]


def _stamp(url: str, spark: SparkSession) -> list:
    """A file's path, size and what changes with any rewrite of it: for a local file its
    modification and change times and inode (see :func:`files.file_stamp`), elsewhere the
    Hadoop filesystem's modification time."""
    fs, path = fsspec.core.url_to_fs(url)
    if "file" in fs.protocol:
        return [url, *file_stamp(fs, path)]
    jvm: Any = spark._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(url)
    status = hadoop_path.getFileSystem(spark._jsparkSession.sessionState().newHadoopConf()).getFileStatus(hadoop_path)
    return [url, int(status.getLen()), int(status.getModificationTime())]


class KeptIngest:
    """One fit's use of kept rows: whether its job reads them or keeps what it brings,
    and its falling back to Spark when a kept part is gone.

    Args:
        spark: The session.
        frame: The training frame (see :func:`frames.training_frame`).
        source: The Parquet files the ranks read themselves (nothing is kept then: they
            are the rows, read at pyarrow's speed), or None.
        workers: The ranks (``numWorkers``).
        limit_mb: ``keepIngestedMB``; 0 keeps nothing.
    """

    def __init__(self, spark: SparkSession, frame: DataFrame, source: FileSource | None, workers: int,
                 limit_mb: float) -> None:
        self.full_frame = frame
        self.frame = frame
        self.plan: KeptPlan | None = None
        self._caches: tuple[int, ...] = ()
        if source is not None or limit_mb <= 0:
            return
        described = frame_key(frame)  # None under Spark Connect, whose client has no JVM
        if described is None:
            logger.info("the rows of this DataFrame are not kept between fits: its plan holds something the key "
                        "cannot describe (a user-defined function, local or RDD data, another data source)")
            return
        key, self._caches = described
        drop = _released(spark)
        mode = "read" if key in _KEPT.keys else "write"
        self.plan = KeptPlan(key=key, mode=mode, limit=int(limit_mb * (1 << 20)), drop=drop)
        if mode == "read":
            self.frame = spark.range(0, workers, 1, workers)
            logger.info("the executors kept this DataFrame's rows from an earlier fit (%s): no scan, no shuffle",
                        key[:12])

    def spec(self, spec: TaskSpec) -> TaskSpec:
        """``spec`` with this fit's plan for kept rows."""
        return replace(spec, kept=self.plan)

    def train(self, run: Callable[[DataFrame, TaskSpec], _T], spec: TaskSpec) -> _T:
        """Runs ``run(frame, spec)``; when the ranks find a kept part gone, runs it again on
        the training frame through Spark, keeping its rows anew. Records the rows as kept
        once a fit that kept them succeeded."""
        try:
            result = run(self.frame, spec)
        except InvalidInputError as error:
            if self.plan is None or self.plan.mode != "read" or MISSING not in str(error):
                raise
            logger.warning("%s: reading it through Spark again", MISSING)
            _KEPT.keys.pop(self.plan.key, None)
            self.plan = replace(self.plan, mode="write")
            result = run(self.full_frame, replace(spec, kept=self.plan))
        if self.plan is not None:
            _KEPT.keys[self.plan.key] = self._caches
        return result


def _released(spark: SparkSession) -> tuple[str, ...]:
    """Forgets the keys of another application (a stopped session's executors removed
    their local directories) and those whose caches were unpersisted; returns the latter,
    for the next job's executors to remove."""
    context = spark.sparkContext
    if _KEPT.app_id != context.applicationId:
        _KEPT.app_id, _KEPT.keys = context.applicationId, {}
        return ()
    persistent = context._jsc.sc().getPersistentRDDs()
    gone = tuple(key for key, caches in _KEPT.keys.items() if not all(persistent.contains(c) for c in caches))
    for key in gone:
        del _KEPT.keys[key]
    return gone
