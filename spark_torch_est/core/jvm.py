"""[driver] Every reach into Spark's JVM (py4j's ``_jsc``, ``_jvm``, ``_jdf``, Spark's
internal classes) and into pyspark's private Python API, in one module.

pyspark's public API does not say how many tasks a cluster can run at once, what a plan
reads, whether a cache is still there, or where an executor in the driver keeps its files;
the package asks the JVM for these here and nowhere else, so that a Spark release that
changes one of them breaks one module, and ``make test-compat`` runs each on every row of
the support matrix. Each function was checked on Spark :data:`CHECKED_ON`.

Under Spark Connect this process has no JVM: each function then returns its "cannot tell"
value (None, or nothing done), as its docstring says, and never raises for that. Databricks'
standard (shared) access mode and serverless compute forbid these calls too (py4j is
blocked): what the package does then is the same as under Connect (docs/cluster.md).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import weakref
from collections.abc import Callable
from typing import Any

import fsspec
import pyarrow as pa
from pyspark import SparkContext
from pyspark.sql import DataFrame, SparkSession

from spark_torch_est.core.file_identity import file_stamp
from spark_torch_est.core.support import installed

__all__ = [
    "CHECKED_ON", "collect_arrow", "sql_settings", "task_slots", "broadcast_threshold", "plan_size_bytes",
    "barrier_partitions", "order_unstable", "parquet_scan", "describe_plan", "cache_alive", "local_dirs",
    "in_caller_properties", "deny_log_records", "context_setting", "one_host",
    "driver_files_dir",
]

logger = logging.getLogger(__name__)

#: The Spark versions every function here was run on (the rows of the support matrix).
CHECKED_ON = ("3.5.0", "3.5.2", "4.0.0", "4.1.0", "4.3.0")

_RUNS_JOBS = re.compile(r"Broadcast|Subquery")  # plan nodes whose preparation starts Spark jobs
_PASS_THROUGH = ("ColumnarToRowExec", "InputAdapter", "WholeStageCodegenExec")
_PLAIN_ATTRIBUTE = re.compile(r"^[^#()]+#\d+L?$")
#: Plan nodes and expressions whose results the plan's text does not determine.
_OPAQUE = re.compile(r"UDF|UDAF|UDTF|Python|Pandas|Arrow|MapPartitions|MapElements|MapGroups|CoGroup|AppendColumns"
                     r"|SerializeFromObject|DeserializeToObject|ScriptTransformation|Invoke|NewInstance|Aggregator"
                     r"|Uuid|Shuffle|Streaming|CollectMetrics")
_CLASS = re.compile(r'"class":"([\w.$]+)"')
_EXPRESSION_ID = re.compile(r"(?<=\w)#(\d+)")  # name#12, name#12L
_FILE_INDEXES = ("InMemoryFileIndex", "PrunedInMemoryFileIndex")
#: Files a scan may list for its plan to be described (each is looked at on the driver).
_MAX_FILES = 10_000


def collect_arrow(df: DataFrame) -> pa.Table:
    """The DataFrame's rows as one Arrow table: ``DataFrame.toArrow`` (Spark 4.0 on, classic
    and Connect), else pyspark 3.5's private ``_collect_as_arrow``."""
    if hasattr(df, "toArrow"):
        return df.toArrow()
    from pyspark.sql.pandas.types import to_arrow_schema

    schema = to_arrow_schema(df.schema)
    # pyspark 3.5's private method: newer pyspark lacks it, and its DataFrame.__getattr__ then
    # types the name as a Column
    return pa.Table.from_batches(df._collect_as_arrow(), schema=schema)  # type: ignore[operator]


def context_setting(context: SparkContext, key: str) -> str | None:
    """One setting of the SparkContext's configuration (None: unset), read in two JVM round
    trips: ``context.getConf()`` copies every setting first, two or three round trips each."""
    return context._conf.get(key)


def sql_settings(spark: SparkSession) -> dict[str, str]:
    """The session's ``spark.sql.*`` settings that differ from Spark's defaults:
    ``RuntimeConfig.getAll`` (Spark 4.0 on), else the session state's (3.5)."""
    if hasattr(type(spark.conf), "getAll"):  # asked of the class: hasattr(spark.conf, ...) fetches them all too
        settings = dict(spark.conf.getAll)
    else:
        confs = spark._jsparkSession.sessionState().conf().getAllConfs()
        jvm: Any = spark._jvm  # None only without a JVM, which has no sessionState above either
        settings = dict(jvm.scala.collection.JavaConverters.mapAsJavaMap(confs))
    return {key: value for key, value in settings.items() if key.startswith("spark.sql.")}


def task_slots(spark: SparkSession) -> int | None:
    """Tasks the cluster can run at once with the default resource profile, or None when
    Spark cannot say (Spark Connect)."""
    try:
        jsc = spark.sparkContext._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # Connect sessions have no SparkContext; Spark's own barrier check remains
        return None


def one_host(spark: SparkSession) -> bool:
    """Whether the driver and every executor run on one host (local mode, a cluster on one
    machine): a file one of them writes, the others can read. False where Spark cannot say
    (Spark Connect)."""
    try:
        context = spark.sparkContext._jsc.sc()
        if context.isLocal():
            return True
        hosts = {str(info.host()) for info in context.statusTracker().getExecutorInfos()}  # the driver's too
    except Exception:  # Connect sessions have no SparkContext
        return False
    if len(hosts) > 1:  # the driver may be "localhost" and its executors 127.0.0.1
        try:
            hosts = {socket.gethostbyname(host) for host in hosts}
        except OSError:
            return False
    return len(hosts) == 1


def broadcast_threshold(spark: SparkSession) -> int:
    """``spark.sql.autoBroadcastJoinThreshold`` as Spark parsed it, in bytes (negative: off)."""
    return int(spark._jsparkSession.sessionState().conf().autoBroadcastJoinThreshold())


def plan_size_bytes(df: DataFrame) -> int:
    """The optimizer's estimate of the DataFrame's size, in bytes."""
    return int(str(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()))  # a BigInt


def barrier_partitions(df: DataFrame) -> int | None:
    """The DataFrame's partition count when a barrier stage can read it as it is and
    Spark knows the count without running a job; else None (then it is repartitioned).

    A plan with a shuffle is adaptive, and asking for its partitions would run the
    shuffle; preparing a plan with a broadcast or a subquery (adaptive execution off) runs
    them. A barrier stage refuses RDD chains whose RDDs differ in partition count
    (``coalesce``, ``union``, partition pruning). None under Spark Connect.
    """
    try:
        return _PARTITIONS[df]
    except (KeyError, TypeError):  # not asked yet, or a DataFrame that cannot be a weak key
        pass
    try:
        execution = df._jdf.queryExecution()
        plan = execution.executedPlan()
        if plan.getClass().getSimpleName() == "AdaptiveSparkPlanExec" or _RUNS_JOBS.search(plan.toString()):
            partitions = None
        else:
            rdd = execution.toRdd()
            partitions = rdd.getNumPartitions() if _barrier_safe(rdd) else None
    except Exception:  # Spark Connect: no JVM handles
        return None
    try:
        _PARTITIONS[df] = partitions
    except TypeError:
        pass
    return partitions


#: :func:`barrier_partitions` of each DataFrame asked (a fit after fit of one DataFrame, the
#: maps of a tuner's split): the answer is fixed for the DataFrame, whose query execution,
#: physical plan and RDD the JVM made once, and finding it takes ~10 py4j round trips an RDD.
_PARTITIONS: weakref.WeakKeyDictionary[DataFrame, int | None] = weakref.WeakKeyDictionary()


def _barrier_safe(rdd: Any, limit: int = 500) -> bool:
    """Whether every RDD a barrier stage would run on top of ``rdd`` (its ancestors up to
    the shuffles) has the same number of partitions, as Spark's barrier check demands."""
    count, stack, seen = rdd.getNumPartitions(), [rdd], 0
    while stack:
        current = stack.pop()
        seen += 1
        if seen > limit or current.getNumPartitions() != count:
            return False
        dependencies = current.dependencies()
        for i in range(dependencies.size()):
            dependency = dependencies.apply(i)
            if dependency.getClass().getName() != "org.apache.spark.ShuffleDependency":
                stack.append(dependency.rdd())
    return True


#: Leaves of a physical plan whose rows come in the same order in every job.
_ORDERED_LEAVES = ("FileSourceScanExec", "InMemoryTableScanExec", "LocalTableScanExec", "RangeExec")
_FILE_SCAN = "org.apache.spark.sql.execution.datasources.v2.FileScan"


def order_unstable(df: DataFrame) -> str | None:
    """Why a job reading ``df`` may see a partition's rows in another order than the job
    before, or None when every job sees the same order: its physical plan shuffles (a
    join, an aggregation, a repartition: a shuffle's output order follows fetch timing),
    or reads a source or an RDD whose order Spark does not fix. A cache is a leaf: its rows
    stay as they were first computed. Under Spark Connect: that the plan cannot be read.

    A fresh plan is asked each time: a DataFrame cached since it was last planned reads the
    cache only in plans made after."""
    try:
        plan = df.select("*")._jdf.queryExecution().executedPlan()
        java: Any = df.sparkSession._jvm
        file_scan = java.java.lang.Class.forName(_FILE_SCAN)
    except Exception:  # Spark Connect: no JVM handles
        return "Spark Connect does not show the DataFrame's plan"
    try:
        return _unstable_node(plan, file_scan)
    except Exception as error:  # a node of another Spark release without the methods asked
        return f"its plan could not be read ({type(error).__name__})"


def _unstable_node(plan: Any, file_scan: Any, limit: int = 2000) -> str | None:
    """:func:`order_unstable` of a physical plan (``file_scan``: the class of DSv2 file scans)."""
    stack, seen = [plan], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > limit:
            return "its plan is too large to check"
        name = node.getClass().getSimpleName()
        if name == "AdaptiveSparkPlanExec":  # its plan so far: exchanges in, stages that ran as query stages
            stack.append(node.executedPlan())
            continue
        if "ShuffleExchange" in name or name == "ShuffleQueryStageExec":
            return f"its plan shuffles ({node.simpleString(1)[:120]})"
        if name == "BroadcastQueryStageExec":
            stack.append(node.plan())
            continue
        children = node.children()
        if children.size():
            stack.extend(children.apply(i) for i in range(children.size()))
        elif name in ("RDDScanExec", "ExternalRDDScanExec"):
            if _shuffled(node.rdd()):
                return f"it reads an RDD made by a shuffle ({node.nodeName()})"
        elif name == "BatchScanExec":
            if not file_scan.isInstance(node.scan()):
                return f"it reads {node.scan().getClass().getSimpleName()}, whose order Spark does not fix"
        elif name not in _ORDERED_LEAVES:
            return f"it reads {node.nodeName()}, whose order Spark does not fix"
    return None


def _shuffled(rdd: Any, limit: int = 500) -> bool:
    """Whether ``rdd`` or an RDD it is made of comes out of a shuffle (or the lineage is too
    long to tell)."""
    stack, seen = [rdd], 0
    while stack:
        current = stack.pop()
        seen += 1
        if seen > limit:
            return True
        dependencies = current.dependencies()
        for i in range(dependencies.size()):
            dependency = dependencies.apply(i)
            if dependency.getClass().getName() == "org.apache.spark.ShuffleDependency":
                return True
            stack.append(dependency.rdd())
    return False


def parquet_scan(df: DataFrame, columns: list[str]) -> tuple[list[str], list[str]] | None:
    """``(root paths, files)`` of a plain Parquet scan that holds ``columns`` (nothing but
    column selection above it, no partition columns, buckets or filters); else None
    (Spark Connect too)."""
    try:
        node = df._jdf.queryExecution().executedPlan()
    except Exception:  # Spark Connect: no JVM handles
        return None
    while True:
        name = node.getClass().getSimpleName()
        if name in _PASS_THROUGH:
            node = node.child()
        elif name == "ProjectExec":
            projected = [node.projectList().apply(i).toString() for i in range(node.projectList().size())]
            if not all(_PLAIN_ATTRIBUTE.match(p) for p in projected):
                return None
            node = node.child()
        else:
            break
    if node.getClass().getSimpleName() != "FileSourceScanExec":
        return None
    relation = node.relation()
    if (relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat"
            or relation.location().getClass().getSimpleName() != "InMemoryFileIndex"
            or relation.partitionSchema().size() or not relation.bucketSpec().isEmpty()
            or node.partitionFilters().size() or node.dataFilters().size()):
        return None
    if not set(columns) <= set(relation.dataSchema().fieldNames()):
        return None
    listed = relation.location().rootPaths()
    return [listed.apply(i).toString() for i in range(listed.size())], sorted(df.inputFiles())


def describe_plan(df: DataFrame) -> tuple[str, list, list[int]] | None:
    """What the DataFrame's rows depend on: its optimized plan's canonical text, what each
    leaf reads, and the ids of the caches among the leaves. None when the plan holds a node,
    an expression or a leaf that cannot be described (user code, local data, other
    sources, streaming), and under Spark Connect.

    Raises:
        Exception: Spark's error (``Py4JJavaError``, or PySpark's captured one such as
            ``PythonException``) when naming a cache's RDD ran a Spark job over the DataFrame
            and it failed (under adaptive execution a cached plan with a shuffle runs its
            map stage as its RDD is built), for the caller to explain.
    """
    try:
        spark = df.sparkSession
        plan = df._jdf.queryExecution().optimizedPlan()
        leaves, caches = _leaves(plan, spark)
        if leaves is None:
            return None
        text = _tree_string(plan.canonicalized()) if installed("pyspark") >= (4, 0) else _numbered(_tree_string(plan))
    except _CacheNotComputed as failed:
        raise failed.error from None
    except Exception as error:  # Spark Connect (no JVM), or a plan the walk does not know
        logger.debug("cannot describe the plan: %s", error)
        return None
    return str(text), leaves, caches


class _CacheNotComputed(Exception):
    """Naming a cache's RDD computed the cache's plan, and Spark's job failed with ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _numbered(text: str) -> str:
    """A plan's text with its expression ids numbered in order of appearance, and a cache's
    plan left out (its identity is among the leaves). Spark 3.5's canonical form leaves a
    cache's output ids as each DataFrame drew them (two reads of one cached table differ),
    so its plans are compared this way instead."""
    lines, cache_depth = [], None
    for line in text.splitlines():
        depth = len(line) - len(line.lstrip(" +-:!"))
        if cache_depth is not None and depth > cache_depth:
            continue
        cache_depth = depth if line[depth:].startswith("InMemoryRelation") else None
        lines.append(line)
    ids: dict[str, int] = {}
    return _EXPRESSION_ID.sub(lambda found: f"#{ids.setdefault(found.group(1), len(ids))}", "\n".join(lines))


def _tree_string(plan: Any) -> str:
    """A plan's whole text, every field shown: ``treeString(verbose, addSuffix, maxFields,
    printOperatorId, printOutputColumns)`` from Spark 4.0, without the last before."""
    from py4j.protocol import Py4JError

    try:
        return str(plan.treeString(True, False, 2 ** 31 - 1, False, False))
    except Py4JError:
        return str(plan.treeString(True, False, 2 ** 31 - 1, False))


def _leaves(plan: Any, spark: SparkSession) -> tuple[list | None, list[int]]:
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


def _leaf(node: Any, name: str, spark: SparkSession) -> list | None:
    if name == "InMemoryRelation":  # the cache's rows stay as they are until it is unpersisted
        try:
            return ["cache", int(node.cacheBuilder().cachedColumnBuffers().id())]
        except Exception as error:  # a job that computed the cache's plan (see describe_plan)
            raise _CacheNotComputed(error) from error
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
    modification and change times and inode (see :func:`~spark_torch_est.core.file_identity.file_stamp`), elsewhere the
    Hadoop filesystem's modification time."""
    fs, path = fsspec.core.url_to_fs(url)
    if "file" in fs.protocol:
        return [url, *file_stamp(fs, path)]
    jvm: Any = spark._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(url)
    status = hadoop_path.getFileSystem(spark._jsparkSession.sessionState().newHadoopConf()).getFileStatus(hadoop_path)
    return [url, int(status.getLen()), int(status.getModificationTime())]


def cache_alive(context: SparkContext) -> Callable[[int], bool]:
    """Whether the RDD of a cache id (see :func:`describe_plan`) is still persisted, as of
    this call."""
    return context._jsc.sc().getPersistentRDDs().contains


def local_dirs(context: SparkContext) -> list[str]:
    """Spark's configured local directories on the driver; empty when they cannot be read."""
    try:
        jvm: Any = context._jvm  # None (a stopped context): the AttributeError below is caught
        return [str(d) for d in jvm.org.apache.spark.util.Utils.getConfiguredLocalDirs(context._jsc.sc().getConf())]
    except Exception as error:
        logger.debug("cannot list Spark's local directories: %s", error)
        return []


def driver_files_dir(context: SparkContext) -> str | None:
    """The driver's folder of files added to the session (``SparkFiles``), inside the
    temporary folder Spark removes when the session stops or the driver's JVM exits; None
    when it cannot be read."""
    try:
        jvm: Any = context._jvm
        return str(jvm.org.apache.spark.SparkFiles.getRootDirectory())
    except Exception as error:
        logger.debug("cannot read the driver's SparkFiles folder: %s", error)
        return None


def in_caller_properties(context: SparkContext) -> Callable[[], None]:
    """A function that gives the thread calling it this thread's local properties (its job
    group, pool, ...), as pyspark's ``inheritable_thread_target`` does."""
    properties = context._jsc.sc().getLocalProperties().clone()
    return lambda: context._jsc.sc().setLocalProperties(properties)


_LOCK = threading.Lock()
_FILTERED: set[int] = set()  # identity hashes of the log4j configurations that hold the filters


def deny_log_records(spark: SparkSession, mdc: dict[str, str], message_regex: str) -> None:
    """Adds two filters to the driver JVM's current log4j configuration, once: one drops
    records whose MDC holds any of ``mdc``'s pairs, one drops records whose message matches
    ``message_regex``. Does nothing under Spark Connect (no JVM here) or where log4j is not
    Spark's logging backend."""
    try:
        jvm: Any = spark.sparkContext._jvm  # None (a stopped context): the AttributeError below is caught
        gateway: Any = spark.sparkContext._gateway
    except Exception:  # Spark Connect: the server's log is not this process's output
        return
    try:
        with _LOCK:
            context = jvm.org.apache.logging.log4j.LogManager.getContext(False)
            configuration = context.getConfiguration()
            key = jvm.java.lang.System.identityHashCode(configuration)
            if key in _FILTERED:
                return
            core = jvm.org.apache.logging.log4j.core
            result = core.Filter.Result
            pairs = gateway.new_array(core.util.KeyValuePair, len(mdc))
            for index, (name, value) in enumerate(mdc.items()):
                pairs[index] = core.util.KeyValuePair(name, value)
            for log_filter in (
                core.filter.ThreadContextMapFilter.createFilter(pairs, "or", result.DENY, result.NEUTRAL),
                core.filter.RegexFilter.createFilter(message_regex, None, False, result.DENY, result.NEUTRAL),
            ):
                log_filter.start()
                configuration.addFilter(log_filter)
            context.updateLoggers()
            _FILTERED.add(key)
    except Exception as error:  # another logging backend: Spark's lines stay, the fit is unaffected
        logger.debug("cannot filter Spark's log: %s", error)
