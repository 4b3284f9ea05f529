"""A rank's part of a Parquet table, read with pyarrow as training-frame batches."""

import json
import os
import subprocess
import sys
import textwrap

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_torch_est.core.protocol import FEATURES, LABEL, input_column
from spark_torch_est.core.spec import FilePart, FileSource, How
from spark_torch_est.errors import InputDataError
from spark_torch_est.ingest.parquet_read import file_stamp, footer_digest, read_part


def _table(path, rows=100, group=30):
    x = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3)
    table = pa.table({"a": x[:, 0], "b": x[:, 1], "v": pa.array(list(x), pa.list_(pa.float64())),
                      "y": np.arange(rows)})
    pq.write_table(table, path, row_group_size=group)


def test_a_part_reads_exactly_its_rows_across_row_groups(tmp_path):
    path = str(tmp_path / "t.parquet")
    _table(path)
    parts = ((FilePart(path, 1, 10, 30), FilePart(path, 2, 0, 5)),)  # rows 40..59 and 60..64
    source = FileSource(outputs=((input_column(0), ("v",), How.AS_IS), (LABEL, ("y",), How.AS_IS)), parts=parts,
                        digest="d")
    batches = list(read_part(source, 0, batch_rows=7))
    labels = np.concatenate([b.column(LABEL).to_numpy() for b in batches])
    assert labels.tolist() == list(range(40, 60)) + list(range(60, 65))
    assert batches[0].schema.names == [input_column(0), LABEL]


def test_numeric_columns_are_stacked_or_wrapped_as_the_frame_would(tmp_path):
    path = str(tmp_path / "t.parquet")
    _table(path, rows=4, group=4)
    source = FileSource(outputs=((FEATURES, ("a", "b"), How.STACK), (LABEL, ("y",), How.AS_IS)),
                        parts=((FilePart(path, 0, 0, 4),),), digest="d")
    (batch,) = read_part(source, 0)
    assert batch.column(FEATURES).to_pylist() == [[0.0, 1.0], [3.0, 4.0], [6.0, 7.0], [9.0, 10.0]]
    source = FileSource(outputs=((FEATURES, ("a",), How.WRAP), (LABEL, ("y",), How.AS_IS)),
                        parts=((FilePart(path, 0, 1, 3),),), digest="d")
    (batch,) = read_part(source, 0)
    assert batch.column(FEATURES).to_pylist() == [[3.0], [6.0]]


def _planned(path, outputs, rows):
    """A one-part source of ``rows`` rows of ``path``, with the file as the driver plans it."""
    size, times = file_stamp(fsspec.filesystem("file"), path)
    with open(path, "rb") as handle:
        digest = footer_digest(handle, size)
    return FileSource(outputs=outputs, parts=((FilePart(path, 0, 0, rows),),), digest="d",
                      files=((path, size, times, digest),))


@pytest.mark.parametrize("change", ["grown", "rewritten"])
def test_a_file_changed_after_planning_is_refused_naming_it(tmp_path, change):
    path = str(tmp_path / "t.parquet")
    plain = dict(compression="none", use_dictionary=False, row_group_size=40)
    table = pa.table({"v": pa.array([[float(i)] for i in range(40)]), "y": np.arange(40)})
    pq.write_table(table, path, **plain)
    source = _planned(path, ((input_column(0), ("v",), How.AS_IS), (LABEL, ("y",), How.AS_IS)), 40)
    assert len(np.concatenate([b.column(LABEL).to_numpy() for b in read_part(source, 0)])) == 40
    stat = os.stat(path)
    if change == "grown":
        _table(path, rows=60, group=40)  # rows appended: the planned rows are still there
    else:  # the labels reversed: the same size, mtime and footer (statistics and offsets)
        pq.write_table(table.set_column(1, "y", pa.array(np.arange(40)[::-1])), path, **plain)
        assert os.path.getsize(path) == stat.st_size
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(InputDataError, match=f"{path} changed after the fit planned its read.*directRead=False"):
        list(read_part(source, 0))


def test_wide_rows_are_read_a_few_megabytes_at_a_time(tmp_path):
    """1,000 rows of 50,000 floats: 200 MB in one batch at the row count alone."""
    path = str(tmp_path / "wide.parquet")
    values = pa.array(np.zeros(1000 * 50_000, dtype=np.float32))
    pq.write_table(pa.table({"v": pa.FixedSizeListArray.from_arrays(values, 50_000).cast(pa.list_(pa.float32())),
                             "y": np.arange(1000)}), path, row_group_size=1000)
    source = _planned(path, ((input_column(0), ("v",), How.AS_IS), (LABEL, ("y",), How.AS_IS)), 1000)
    sizes = [batch.nbytes for batch in read_part(source, 0)]
    assert sum(sizes) >= 200e6 and max(sizes) <= 4.5 * 2 ** 20


def test_wide_rows_keep_a_rank_near_its_memory_budget(tmp_path):
    """1,000 rows x 50,000 float32 (200 MB) with a 16 MB budget, measured in a fresh process:
    batches of 16,384 rows would hold the whole part at once (~410 MB of growth)."""
    path = str(tmp_path / "wide.parquet")
    values = pa.array(np.random.default_rng(0).normal(size=1000 * 50_000).astype(np.float32))
    pq.write_table(pa.table({"v": pa.FixedSizeListArray.from_arrays(values, 50_000).cast(pa.list_(pa.float32())),
                             "y": np.arange(1000.0)}), path, row_group_size=1000)
    del values
    probe = textwrap.dedent(f"""
        import json, sys
        import fsspec
        sys.path.insert(0, ".")
        from spark_torch_est.ingest.tables import read_rows
        from spark_torch_est.ingest.parquet_read import file_stamp, footer_digest, read_part
        from spark_torch_est.core.protocol import LABEL, input_column
        from spark_torch_est.core.spec import ColumnNames, FilePart, FileSource, How
        from tests.helpers import features_schema
        path = {path!r}
        size, times = file_stamp(fsspec.filesystem("file"), path)
        with open(path, "rb") as handle:
            digest = footer_digest(handle, size)
        source = FileSource(outputs=((input_column(0), ("v",), How.AS_IS), (LABEL, ("y",), How.AS_IS)),
                            parts=((FilePart(path, 0, 0, 1000),),), digest="d", files=((path, size, times, digest),))
        def hwm():
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) // 1024
        base = hwm()
        ingested = read_rows(read_part(source, 0), features_schema(50_000, name=input_column(0)), ColumnNames(),
                             16 << 20, 1000)
        print(json.dumps({{"growth_mb": hwm() - base, "rows": len(ingested.train.inputs[0])}}))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print("peak RSS growth, 200 MB of wide rows, 16 MB budget:", result)
    assert result["rows"] == 1000 and result["growth_mb"] < 16 + 96  # the budget, batches in flight, slack
