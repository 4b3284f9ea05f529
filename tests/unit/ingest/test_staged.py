"""The staged rows: each rank reads, from the files a staging job wrote (one per input
partition), the rows a shuffle by position would bring it: position ``p * 2**33 + k`` of row
``k`` of partition ``p``, logical partition ``position mod L``, in order."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from spark_torch_est.core.spec import StagedRows
from spark_torch_est.ingest.staged import (
    STAGED_MISSING,
    StagedPartMissing,
    _every,
    _strided,
    part_file,
    shard_rows,
    staged_batches,
    write_partition,
)

SCHEMA = pa.schema([("id", pa.int64()), ("features", pa.list_(pa.float32()))])


def _batches(ids: list[int], batch_rows: int):
    for start in range(0, len(ids), batch_rows):
        chunk = ids[start:start + batch_rows]
        yield pa.RecordBatch.from_arrays(
            [pa.array(chunk, pa.int64()), pa.array([[float(i), -float(i)] for i in chunk], pa.list_(pa.float32()))],
            schema=SCHEMA)


def _staged(tmp_path, sizes: list[int], batch_rows: int, shards: int) -> tuple[StagedRows, list[tuple[int, int]]]:
    """Partitions of ``sizes`` rows written as the staging job writes them; each row's id is
    its (partition, row) as ``p * 1000 + k``."""
    rows = []
    for p, size in enumerate(sizes):
        assert write_partition(str(tmp_path), shards, p, _batches([p * 1000 + k for k in range(size)], batch_rows)) \
            == size
        rows += [(p, k) for k in range(size)]
    return StagedRows(str(tmp_path), tuple(enumerate(sizes))), rows


def _read(staged: StagedRows, shard: int, shards: int) -> list[int]:
    ids = []
    for batch in staged_batches(staged, shard, shards):
        ids += batch.column("id").to_pylist()
        assert batch.column("features").to_pylist() == [[float(i), -float(i)] for i in batch.column("id").to_pylist()]
    return ids


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
@pytest.mark.parametrize("sizes, batch_rows", [([10, 0, 7, 1], 3), ([1], 4), ([0, 0, 9], 2), ([33, 34, 35], 8)])
def test_each_rank_reads_the_rows_a_shuffle_by_position_would_bring_it_in_their_order(tmp_path, shards, sizes,
                                                                                        batch_rows):
    staged, rows = _staged(tmp_path, sizes, batch_rows, shards)
    got = [_read(staged, shard, shards) for shard in range(shards)]
    for shard in range(shards):  # what the training frame's shuffle defines (frames._by_position)
        expected = sorted(((p << 33) + k, p * 1000 + k) for p, k in rows if ((p << 33) + k) % shards == shard)
        assert got[shard] == [row_id for _, row_id in expected]
        assert sum(shard_rows(p, size, shard, shards) for p, size in enumerate(sizes)) == len(expected)
    assert sorted(sum(got, [])) == sorted(p * 1000 + k for p, k in rows), "every row once"
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name], "no writer's file is left"


def test_a_file_gone_or_not_as_written_stops_the_rank_with_the_error_the_driver_reads_through_the_shuffle_on(
        tmp_path):
    staged, _ = _staged(tmp_path, [4, 5], 2, 2)
    os.remove(part_file(str(tmp_path), 1, 0))
    with pytest.raises(StagedPartMissing, match=STAGED_MISSING):
        _read(staged, 0, 2)
    write_partition(str(tmp_path), 2, 1, _batches([1000, 1001], 2))  # fewer rows than the staging job wrote
    with pytest.raises(StagedPartMissing, match="holds 1 rows, the staging job wrote 2"):
        _read(staged, 1, 2)


def _columns(rows: int) -> pa.RecordBatch:
    """A batch of the column types Spark sends, with and without nulls, even and ragged arrays."""
    ids = list(range(rows))
    return pa.RecordBatch.from_pydict({
        "long": pa.array(ids, pa.int64()),
        "int": pa.array(ids, pa.int32()),
        "double": pa.array([i / 3 for i in ids], pa.float64()),
        "float_nulls": pa.array([None if i % 4 == 1 else float(i) for i in ids], pa.float32()),
        "flag": pa.array([i % 3 == 0 for i in ids]),
        "text": pa.array([f"row {i}" for i in ids]),
        "floats": pa.array([[float(i), i + 0.5, -float(i)] for i in ids], pa.list_(pa.float32())),
        "ids": pa.array([[i, i + 1] for i in ids], pa.large_list(pa.int64())),
        "ragged": pa.array([[float(i)] * (i % 3) for i in ids], pa.list_(pa.float64())),
        "null_array": pa.array([None if i == 2 else [float(i)] for i in ids], pa.list_(pa.float64())),
        "null_element": pa.array([[None if i == 3 else float(i)] for i in ids], pa.list_(pa.float64())),
        "empty": pa.array([[] for _ in ids], pa.list_(pa.float32())),
        "stamp": pa.array([i * 1000 for i in ids], pa.timestamp("us", tz="UTC")),
    })


@pytest.mark.parametrize("rows, offset, start, step", [(10, 0, 0, 2), (10, 0, 1, 2), (11, 3, 2, 3), (11, 3, 4, 5),
                                                     (1, 0, 0, 2), (7, 0, 6, 4)])
def test_a_batch_is_dealt_out_as_arrow_take_deals_it(rows, offset, start, step):
    batch = _columns(rows + offset).slice(offset)  # Spark's batches may be slices too
    dealt = _every(batch, start, step)
    assert dealt.schema == batch.schema
    assert dealt.equals(batch.take(pa.array(range(start, batch.num_rows, step), pa.int64())))
    copied = {name for name in batch.schema.names if _strided(batch.column(name), start, step) is not None}
    with_nulls = {name for name in batch.schema.names
                  if batch.column(name).null_count or "null_" in name and batch.column(name).flatten().null_count}
    assert copied - {"float_nulls", "null_array", "null_element"} == {"long", "int", "double", "floats", "ids"}, \
        "numbers and arrays of them all of one length are copied with a stride ..."
    assert not copied & with_nulls, "... where none is null"
