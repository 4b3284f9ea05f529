"""[driver] Reading a plain Parquet table straight from its files, at the speed of pyarrow.

Most training DataFrames are a Parquet table as it is: ``spark.read.parquet(path)``,
maybe with some columns selected. For those, sending every row through the JVM (row
format, a shuffle into ``numWorkers`` partitions, conversion to Arrow) costs several times
what reading the files costs. So when the plan is exactly such a scan, the driver reads
the files' footers, splits the table's rows evenly into one part per rank (row groups
and row ranges, in file order), and each rank reads its part with pyarrow: no shuffle, no
JVM conversion, exactly even parts. Anything else (a filter, a join, a cache, Delta or
other table formats, partition columns, files on a remote store such as S3 or HDFS,
Spark Connect, files the driver cannot open, ``directRead=False``) takes the general path
through Spark.

``TorchModel.transform`` and ``evaluate`` read such a table the same way
(:func:`parquet_table`), but only when every column they pass on comes out of pyarrow as
the very Arrow data Spark would hand a Python function: integers, floats, booleans,
strings, binary, and arrays and structs (Vectors) of those. Other types (decimals, dates,
timestamps, maps, unsigned integers) go through Spark, whose readers decide their values.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable

from pyspark.sql import DataFrame

from spark_torch_est.core import jvm
from spark_torch_est.core.file_identity import file_stamp, footer_digest
from spark_torch_est.core.spec import FilePart, FileSource, How
from spark_torch_est.ingest.spark_types import ARROW_NAMES, arrow_name

__all__ = ["parquet_source", "parquet_table", "scoring_parts"]

logger = logging.getLogger(__name__)

#: Bytes (uncompressed) per part of :func:`parquet_table`: between these, the table over the cores, as
#: Spark sizes its splits (``spark.sql.files.maxPartitionBytes``, ``spark.sql.files.openCostInBytes``).
_PART_BYTES = (4 * 2 ** 20, 128 * 2 ** 20)
#: :func:`parquet_table` reads every file's footer on the driver at each call: beyond this many files, Spark scans.
_MAX_FILES = 1000


def parquet_source(df: DataFrame, outputs: list[tuple[str, tuple[str, ...], How]],
                   num_workers: int) -> FileSource | None:
    """A :class:`FileSource` split into ``num_workers`` parts, when ``df`` is a plain scan of
    Parquet files the driver can read; else None.

    Args:
        df: The training DataFrame.
        outputs: The training frame's columns: ``(name, file columns, how)`` (see
            :class:`spec.FileSource`).
        num_workers: The ranks.
    """
    columns = list(dict.fromkeys(name for _, sources, _ in outputs for name in sources))
    files = _scanned_files(df.select(*[df[name] for name in columns]), columns)  # a fresh plan: caches count
    if not files:
        return None
    types = {name: arrow_name(df.schema[name].dataType) for name in columns}
    try:
        return _split(files, tuple(outputs), num_workers, types, larger_first=True)
    except Exception as error:  # unreadable files, unknown URL schemes: Spark reads them instead
        logger.info("reading the table through Spark: its files cannot be read directly (%s: %s)",
                    type(error).__name__, error)
        return None


def parquet_table(df: DataFrame, slots: int) -> FileSource | None:
    """All of ``df`` in parts sized as Spark sizes its splits (4-128 MB, the table spread
    over ``slots`` cores; a multiple of ``slots`` when there are more parts than cores), when
    ``df`` is a plain scan of at most ``_MAX_FILES`` Parquet files the driver can read and
    every column is of a type pyarrow reads exactly as Spark passes it to Python; else None."""
    columns, fields = df.columns, df.schema.fields
    types = {field.name: arrow_name(field.dataType) for field in fields}
    if len(set(columns)) != len(columns) or None in types.values():
        return None
    files = _scanned_files(df.select(*[df[name] for name in columns]), columns)  # a fresh plan: caches count
    if not files or len(files) > _MAX_FILES:
        return None
    try:
        return _split(files, tuple((name, (name,), How.AS_IS) for name in columns),
                      lambda size, rows: scoring_parts(size, rows, slots), types)
    except Exception as error:  # unreadable files, unknown URL schemes, other types: Spark reads them instead
        logger.info("reading the table through Spark: its files cannot be read directly (%s: %s)",
                    type(error).__name__, error)
        return None


def scoring_parts(size: int, rows: int, slots: int) -> int:
    """How many parts :func:`parquet_table` cuts a table of ``size`` uncompressed bytes and
    ``rows`` rows into for ``slots`` cores: parts of 4-128 MB, the table spread over the
    cores, rounded up to whole waves when there are more parts than cores; never an empty
    part (one for an empty table)."""
    count = -(-size // min(_PART_BYTES[1], max(_PART_BYTES[0], size // slots)))
    if count > slots:
        count = -(-count // slots) * slots
    return max(1, min(count, rows))


def _arrow_type(arrow_type) -> object:
    """An Arrow type as :func:`_spark_type` writes the Spark type it stands for; None when
    Spark would not take it as it is (large and fixed-size lists, unsigned integers, ...)."""
    import pyarrow as pa

    if pa.types.is_list(arrow_type):
        element = _arrow_type(arrow_type.value_type)
        return None if element is None else ("array", element)
    if pa.types.is_struct(arrow_type):
        members = tuple((f.name, _arrow_type(f.type)) for f in arrow_type)
        return None if any(t is None for _, t in members) else ("struct", members)
    name = str(arrow_type)
    return name if name in ARROW_NAMES else None


def _scanned_files(df: DataFrame, columns: list[str]) -> list[str] | None:
    """The files of a plain Parquet scan (nothing but column selection above it), sorted; else None."""
    scan = jvm.parquet_scan(df, columns)
    if scan is None:
        return None
    roots, files = scan
    if _overlapping(roots):  # Spark reads a file once per path that lists it; inputFiles() names it once
        logger.info("reading the table through Spark: its paths overlap (%s)", roots)
        return None
    return files


def _overlapping(paths: list[str]) -> bool:
    """Whether a path is listed twice, or inside another listed path."""
    trimmed = sorted(path.rstrip("/") for path in paths)
    return any(later == earlier or later.startswith(earlier + "/") for earlier, later in zip(trimmed, trimmed[1:]))


def _split(files: list[str], outputs: tuple, parts: int | Callable[[int, int], int],
           types: dict[str, object] | None = None, larger_first: bool = False) -> FileSource:
    """Rows ``[r * n / parts, (r + 1) * n / parts)`` of the files, in file order, for each
    part ``r`` (the boundaries of ``spark.range(0, n, 1, parts)``'s partitions); with
    ``larger_first`` the parts one row longer come first, as the run's logical shards
    (:func:`~spark_torch_est.ingest.canonical.by_source_order`), so that on as many ranks as
    logical shards each rank reads its logical shard's rows and none move.

    Args:
        files: The table's files.
        outputs: See :class:`FileSource`.
        parts: How many parts, or a function of the table's uncompressed bytes and rows
            that says how many.
        types: Column -> :func:`_spark_type`: every file must hold exactly those types (a
            column whose type is None: the same type in every file).

    Raises:
        ValueError: A file is not local, lacks a column, or holds another type.
    """
    import fsspec
    import pyarrow.parquet as pq

    needed = {name for _, sources, _ in outputs for name in sources}
    groups: list[tuple[str, int, int]] = []  # (file, row group, rows)
    stamps = []  # (file, size, times, footer digest)
    seen: dict[str, str] = {}  # column -> its Arrow type in the first file
    size = 0
    for url in files:
        fs, path = fsspec.core.url_to_fs(url)
        if "file" not in fs.protocol:  # executors may lack this store's library or credentials: Spark reads it
            raise ValueError(f"{url} is not on a local or mounted filesystem")
        with fs.open(path, "rb") as handle:
            reader = pq.ParquetFile(handle)
            missing = needed - set(reader.schema_arrow.names)
            if missing:  # other letter case, or schema evolution: Spark resolves those, pyarrow would not
                raise ValueError(f"{url} has no column(s) {sorted(missing)} by those exact names")
            for name, expected in (types or {}).items():
                found = reader.schema_arrow.field(name).type
                if (_arrow_type(found) != expected if expected is not None
                        else seen.setdefault(name, str(found)) != str(found)):  # Spark may refuse or convert it
                    raise ValueError(f"{url}: column {name!r} is {found} in the file")
            metadata = reader.metadata
            file_size, times = file_stamp(fs, path)
            stamps.append((url, file_size, times, footer_digest(handle, file_size)))
        size += sum(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
        groups.extend((url, g, metadata.row_group(g).num_rows) for g in range(metadata.num_row_groups))
    total = sum(rows for _, _, rows in groups)
    if callable(parts):
        parts = parts(size, total)
    bounds = ([rank * (total // parts) + min(rank, total % parts) for rank in range(parts + 1)] if larger_first
              else [rank * total // parts for rank in range(parts + 1)])
    assigned: list[list[FilePart]] = [[] for _ in range(parts)]
    first = 0
    for url, group, rows in groups:
        for rank in range(parts):
            start, stop = max(first, bounds[rank]), min(first + rows, bounds[rank + 1])
            if start < stop:
                assigned[rank].append(FilePart(url, group, start - first, stop - first))
        first += rows
    plan = json.dumps([[[list(map(str, (p.path, p.row_group, p.start, p.stop))) for p in part] for part in assigned],
                       stamps])
    return FileSource(outputs=outputs, parts=tuple(tuple(part) for part in assigned),
                      digest=hashlib.sha256(plan.encode()).hexdigest()[:16], files=tuple(stamps))
