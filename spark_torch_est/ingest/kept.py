"""[executor] The kept rows: each rank's part of a DataFrame, as the rank received it from
Spark, on its executor's local disk between fits; the part a Python worker trained on last
is also held in its memory (the held rows, :mod:`spark_torch_est.ingest.held`). A later fit
on the same unchanged DataFrame (the driver says so with the same key, see
:mod:`spark_torch_est.ingest.kept_registry`) runs no scan and no shuffle: its ranks tell each
other which parts they hold and take the rank numbers that match.

On disk, under the executor's first Spark local directory (``SPARK_LOCAL_DIRS``: Spark's
block manager directory, removed when the executor or the session stops)::

    spark_torch_est-kept/<key>/part-00001-of-00002/00000.arrow   # Arrow IPC files of the part's batches

A part is a folder of Arrow IPC files, read in the order of their names: the batches a rank
received from Spark, written beside the ingest; or, where the rank read them from a staging
job's files (:mod:`spark_torch_est.ingest.staged`), those files themselves, hard-linked,
not copied. A part is made in a folder of its own writer (``part-...tmp-<pid>-<random>``),
renamed into place once whole, and the key's folder is touched on every use; past
``keepIngestedMB`` on one executor the least recently used keys are removed. Two fits that
keep one part at once (two estimators' first fits of one cached DataFrame) each make their
own folder; the first renamed into place stays, and both are whole.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from spark_torch_est.core.spec import KeptPlan, TaskSpec
from spark_torch_est.errors import InputDataError
from spark_torch_est.ingest import held
from spark_torch_est.ingest.columns import spark_local_dir
from spark_torch_est.ingest.tables import IngestedRows, read_rows

__all__ = ["KEPT_FOLDER", "MISSING", "KeptPartMissing", "kept_root", "part_path", "assign", "keep_while_reading",
           "take_kept", "drop"]

logger = logging.getLogger(__name__)

KEPT_FOLDER = "spark_torch_est-kept"
#: Starts the message of :class:`KeptPartMissing`: the driver reads the rows through Spark again.
MISSING = "the kept rows of this DataFrame are gone"
_MEMORY_PREFIX = "kept/"  # kept rows held in memory (ingest.held) are keyed below it


class KeptPartMissing(InputDataError):
    """No rank of the job holds a part the driver expected kept (evicted, or its executor
    is gone); the driver then reads the DataFrame through Spark again."""


def kept_root() -> str:
    """Where this executor keeps parts."""
    return os.path.join(spark_local_dir(), KEPT_FOLDER)


def part_path(key: str, part: int, parts: int) -> str:
    """The folder of part ``part`` of ``parts`` of the rows under ``key``."""
    return os.path.join(kept_root(), key, f"part-{part:05d}-of-{parts:05d}")


def drop(keys: tuple[str, ...]) -> None:
    """Removes what this executor keeps under ``keys`` (their DataFrames' caches are gone)."""
    for key in keys:
        shutil.rmtree(os.path.join(kept_root(), key), ignore_errors=True)
    held.forget(*(_MEMORY_PREFIX + key + "/" for key in keys))


def _memory_key(spec: TaskSpec, plan: KeptPlan, part: int) -> str:
    """The key's rows converted for this fit: the schema, columns and budget shape the tensors."""
    return f"{_MEMORY_PREFIX}{plan.key}/{part}/{spec.world_size}/" + json.dumps(
        [spec.schema.to_dict(), [spec.columns.label, spec.columns.weight, spec.columns.features],
         spec.memory_budget], default=str)


def keep_while_reading(spec: TaskSpec, batches: Iterator[pa.RecordBatch], part: int,
                       files: Sequence[str] = ()) -> IngestedRows:
    """This rank's rows from the job's input, kept on the executor's local disk (keeping
    them may fail: that only costs the next fit its reuse) and, once kept there within the
    bound, held in this worker's memory too. ``files``: the staged files the batches are
    read from, in order, which are kept as they are where this disk can link them, instead
    of writing the batches again as they come."""
    plan = _plan(spec)
    held.forget()
    _drop_requested(plan)
    keeping = _NewPart.make(plan, part, spec.world_size)
    if keeping is not None and not (files and keeping.link(files)):
        batches = keeping.write(batches)
    try:
        ingested = read_rows(batches, spec.schema, spec.columns, spec.memory_budget)
    except BaseException:
        if keeping is not None:
            keeping.abandon()
        raise
    if keeping is not None:
        keeping.commit()
    if os.path.isdir(part_path(plan.key, part, spec.world_size)):  # kept within the bound: held as well
        ingested.source, ingested.reread = _memory_key(spec, plan, part), lambda: _read_kept(spec, plan, part)
        held.hold(ingested.source, ingested)
    return ingested


def _read_kept(spec: TaskSpec, plan: KeptPlan, part: int) -> IngestedRows:
    """The rows of ``part`` this executor kept on disk, as rows a later fit may hold.

    Raises:
        KeptPartMissing: The part is gone (evicted since).
    """
    path = part_path(plan.key, part, spec.world_size)
    if not os.path.exists(path):
        raise KeptPartMissing(f"{MISSING} (part {part} left this executor's disk)")
    ingested = read_rows(_read(path), spec.schema, spec.columns, spec.memory_budget)
    pa.default_memory_pool().release_unused()
    ingested.source, ingested.reread = _memory_key(spec, plan, part), lambda: _read_kept(spec, plan, part)
    return ingested


def _plan(spec: TaskSpec) -> KeptPlan:
    if spec.kept is None:
        raise ValueError("this fit keeps no rows (TaskSpec.kept is None)")
    return spec.kept


def _drop_requested(plan: KeptPlan) -> None:
    if plan.drop:
        drop(plan.drop)


class _NewPart:
    """A part being kept, in a folder of this writer's own that becomes the part, renamed
    into place, only once it holds every row: a failed or abandoned ingest leaves none.
    Made with :meth:`make`."""

    def __init__(self, plan: KeptPlan, path: str) -> None:
        self.plan, self.path = plan, path
        self.folder = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
        self.failed = False

    @classmethod
    def make(cls, plan: KeptPlan, part: int, parts: int) -> _NewPart | None:
        """The new part's folder, made; what a rank that died keeping this part left goes
        (what a live process keeps, another fit's rank, stays). None, with a warning, when
        the disk takes no folder."""
        new = cls(plan, part_path(plan.key, part, parts))
        try:
            os.makedirs(os.path.dirname(new.path), exist_ok=True)
            for stale in glob.glob(f"{glob.escape(new.path)}.tmp-*"):
                if not _writer_alive(stale):
                    _remove(stale)
            os.mkdir(new.folder)
        except OSError as error:
            logger.warning("cannot keep this part's rows for later fits (%s)", error)
            return None
        return new

    def link(self, files: Sequence[str]) -> bool:
        """Keeps ``files`` as they are (hard links: nothing is copied); False, the folder
        emptied, where this disk cannot link them (another file system)."""
        try:
            for index, file in enumerate(files):
                os.link(file, self._file(index))
        except OSError:
            _remove(self.folder)  # the links made so far (not the files they link), in a folder made anew
            try:
                os.mkdir(self.folder)
            except OSError as error:
                self._fail(error)
            return False
        return True

    def write(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """``batches``, each also appended to the part's one file (an empty partition: a
        file without columns). A write that fails (a full disk) warns, and the rows are
        not kept."""
        if self.failed:
            yield from batches
            return
        try:
            sink = open(self._file(0), "wb")
        except OSError as error:
            self._fail(error)
            yield from batches
            return
        writer: Any = None
        with sink:
            for batch in batches:
                if not self.failed:
                    try:
                        if writer is None:
                            writer = pa.ipc.new_file(sink, batch.schema)
                        writer.write_batch(batch)
                    except (OSError, pa.ArrowException) as error:
                        self._fail(error)
                yield batch
            if not self.failed:
                try:
                    (writer or pa.ipc.new_file(sink, pa.schema([]))).close()
                except (OSError, pa.ArrowException) as error:
                    self._fail(error)

    def commit(self) -> None:
        """The part in place (unless a write failed, or another fit's rank put it there
        first: the same rows, whole), then the executor's parts within the bound."""
        if self.failed:
            self.abandon()
            return
        try:
            os.rename(self.folder, self.path)
        except OSError as error:
            self.abandon()
            if not os.path.isdir(self.path):
                logger.warning("cannot keep this part's rows for later fits (%s)", error)
                return
        _evict(self.plan.limit, keep=self.plan.key)

    def abandon(self) -> None:
        _remove(self.folder)

    def _file(self, index: int) -> str:
        return os.path.join(self.folder, f"{index:05d}.arrow")

    def _fail(self, error: Exception) -> None:
        logger.warning("cannot keep this part's rows for later fits (%s)", error)
        self.failed = True


def _remove(path: str) -> None:
    """Removes a part's folder (or a file of an older version), or what is left of it."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def _writer_alive(temporary: str) -> bool:
    """Whether the process that makes ``temporary`` (named by :class:`_NewPart`) still runs; a
    name without a process id (an older version's) counts as left by a dead one."""
    pid, separator, _ = temporary.rsplit(".tmp-", 1)[-1].partition("-")
    if not (separator and pid.isdigit()):
        return False
    if int(pid) == os.getpid() or os.name == "nt":  # Windows has no harmless probe (os.kill terminates)
        return True
    try:
        os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
    except PermissionError:  # another user's process
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return True


def _read(path: str) -> Iterator[pa.RecordBatch]:
    """The batches of a kept part, memory-mapped (the page cache holds them, not the
    process); the mapping lasts as long as a batch or a view of it does.

    Raises:
        KeptPartMissing: The part was removed meanwhile (evicted by another rank).
    """
    try:
        names = sorted(os.listdir(path))
        for name in names:
            reader = pa.ipc.open_file(pa.memory_map(os.path.join(path, name)))
            for index in range(reader.num_record_batches):
                yield reader.get_batch(index)
    except FileNotFoundError:
        raise KeptPartMissing(f"{MISSING} (part {os.path.basename(path)} left this executor's disk)") from None


def _size(path: str) -> int:
    """The bytes of a part's files."""
    with os.scandir(path) as files:
        return sum(file.stat().st_size for file in files)


def _evict(limit: int, keep: str) -> None:
    """Removes the complete parts of the least recently used keys (their folders'
    modification times) until the executor keeps at most ``limit`` bytes; ``keep`` goes
    last, when it alone is past it. Parts being made (another rank's, beside this one)
    are left alone; a part goes at once (renamed away as a dead writer's, then removed),
    so no rank reads a part half removed."""
    root = kept_root()
    parts: dict[str, list[tuple[str, int]]] = {}
    used: dict[str, float] = {}
    for path in glob.glob(os.path.join(glob.escape(root), "*", "part-*")):
        if ".tmp-" in os.path.basename(path):
            continue
        try:
            size = _size(path)
            key = os.path.basename(os.path.dirname(path))
            used.setdefault(key, os.path.getmtime(os.path.dirname(path)))
        except OSError:  # removed meanwhile by another rank of this executor
            continue
        parts.setdefault(key, []).append((path, size))
    total = sum(size for files in parts.values() for _, size in files)
    for key in sorted(parts, key=lambda k: (k == keep, used[k])):
        if total <= limit:
            break
        for path, size in parts[key]:
            going = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
            with contextlib.suppress(OSError):
                os.rename(path, going)
                _remove(going)
            total -= size
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(root, key))  # unless a part is being made there
        logger.info("removed the kept rows %s (keepIngestedMB: %d MB per executor)", key[:12], limit >> 20)


def assign(offers: list[dict[str, list[int]]], parts: int) -> list[int] | None:
    """Which part each task trains on (its rank): a perfect matching of tasks to parts that
    they hold, with as many parts held in memory as can be kept so; None when the parts
    the tasks hold cannot cover every part.

    >>> assign([{"memory": [], "disk": [0, 1]}, {"memory": [0], "disk": [0, 1]}], 2)
    [1, 0]
    """
    if len(offers) != parts:
        return None
    memory = [[p for p in offer.get("memory", ()) if 0 <= p < parts] for offer in offers]
    either = [[p for tier in ("memory", "disk") for p in offer.get(tier, ()) if 0 <= p < parts] for offer in offers]
    owner = _match(either, _match(memory, {}))  # memory holders keep their parts, the rest match around them
    if len(owner) < parts:
        owner = _match(either, {})
    if len(owner) < parts:
        return None
    ranks = [0] * parts
    for part, task in owner.items():
        ranks[task] = part
    return ranks


def _match(edges: list[list[int]], fixed: dict[int, int]) -> dict[int, int]:
    """A maximum matching ``{part: task}`` of ``edges`` (each task's parts) that keeps the
    pairs of ``fixed`` (augmenting paths; a handful of tasks)."""
    owner = dict(fixed)

    def place(task: int, seen: set[int]) -> bool:
        for part in edges[task]:
            if part not in seen and part not in fixed:
                seen.add(part)
                if part not in owner or place(owner[part], seen):
                    owner[part] = task
                    return True
        return False

    placed = set(fixed.values())
    for task in range(len(edges)):
        if task not in placed:
            place(task, set())
    return owner


def _offer(spec: TaskSpec, plan: KeptPlan) -> dict[str, list[int]]:
    """The parts of the key this task holds: in this worker's memory, on this executor's disk."""
    memory = [part for part in range(spec.world_size) if held.holds(_memory_key(spec, plan, part))]
    disk = [part for part in range(spec.world_size) if os.path.exists(part_path(plan.key, part, spec.world_size))]
    return {"memory": memory, "disk": disk}


def _parse_offer(raw: bytes) -> dict[str, list[int]]:
    """An offer read from the store, which anyone who reaches it can write: checked, and
    empty when malformed (the worst a forged offer does is fail the job)."""
    try:
        offer = json.loads(raw.decode())
        return {tier: [int(p) for p in offer.get(tier, []) if isinstance(p, int) and not isinstance(p, bool)]
                for tier in ("memory", "disk")}
    except (ValueError, AttributeError, TypeError, UnicodeDecodeError):
        return {"memory": [], "disk": []}


def take_kept(spec: TaskSpec, batches: Iterator[pa.RecordBatch], store: Any, task: int) -> tuple[int, IngestedRows]:
    """The rank this task takes and its rows, from what the tasks hold of the key: each
    task says which parts it holds (through the job's rendezvous store), every task
    computes the same :func:`assign`, and loads its part from memory or disk.

    Raises:
        KeptPartMissing: The tasks do not hold every part between them.
    """
    for _ in batches:  # the job's input: one row per task, nothing to train on
        pass
    plan = _plan(spec)
    _drop_requested(plan)
    store.set(f"kept-offer/{task}", json.dumps(_offer(spec, plan)))
    offers = [_parse_offer(store.get(f"kept-offer/{other}")) for other in range(spec.world_size)]
    ranks = assign(offers, spec.world_size)
    if ranks is None:
        raise KeptPartMissing(f"{MISSING} (the tasks hold {offers} of {spec.world_size} parts)")
    rank = ranks[task]
    memory_key = _memory_key(spec, plan, rank)
    ingested = held.held(memory_key)
    if ingested is not None:
        logger.info("rank %d: training on the rows this worker holds from an earlier fit", rank)
    else:
        held.forget()
        ingested = _read_kept(spec, plan, rank)
        held.hold(memory_key, ingested)
        logger.info("rank %d: training on the rows this executor kept on disk from an earlier fit", rank)
    try:
        os.utime(os.path.dirname(part_path(plan.key, rank, spec.world_size)))  # recently used: evicted last
    except OSError:
        pass
    return rank, ingested
