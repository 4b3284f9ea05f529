import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from spark_torch_est.core.arrow import binary_array, from_numpy, to_numpy

pytestmark = pytest.mark.compat  # each pyarrow of the support matrix: its buffers, and what imports pandas


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64, np.float16,
                                   np.float32, np.float64, np.bool_])
def test_to_numpy_gives_pyarrows_values_for_whole_sliced_and_chunked_arrays(dtype):
    array = pa.array((np.arange(70) % 2 if dtype is np.bool_ else np.arange(70)).astype(dtype))
    for part in (array, array.slice(5, 53), array.slice(70), pa.chunked_array([array.slice(0, 9), array.slice(31, 3)])):
        expected = part.to_numpy() if isinstance(part, pa.ChunkedArray) else part.to_numpy(zero_copy_only=False)
        got = to_numpy(part)
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)


def test_to_numpy_leaves_nulls_and_other_types_to_pyarrow():
    with_nulls = to_numpy(pa.array([1.5, None]))
    assert with_nulls[0] == 1.5 and np.isnan(with_nulls[1])
    dates = pa.array([1, 2], pa.date32())
    np.testing.assert_array_equal(to_numpy(dates), dates.to_numpy(zero_copy_only=False))


def test_from_numpy_wraps_the_memory_and_rejects_what_is_not_a_vector_of_numbers():
    values = np.arange(6, dtype=np.float32)
    array = from_numpy(values)
    assert array.type == pa.float32() and array.to_pylist() == values.tolist()
    assert from_numpy([3, 4]).type == pa.int64()
    assert from_numpy(values.reshape(2, 3)[:, 1]).to_pylist() == [1.0, 4.0], "a strided view is made contiguous"
    for wrong in (values.reshape(2, 3), np.array([True])):
        with pytest.raises(TypeError, match="one dimension of numbers"):
            from_numpy(wrong)


def test_binary_array_holds_each_item():
    items = [b"ab", memoryview(b"xyz")[1:], b""]
    assert binary_array(items).to_pylist() == [b"ab", b"yz", b""]
    assert binary_array([]).to_pylist() == []


_RANK_PATH = """
import os, sys, tempfile
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
from spark_torch_est.cluster.worker import _result_row
from spark_torch_est.core.arrow import binary_array, from_numpy
from spark_torch_est.core.protocol import IS_VALIDATION, LABEL, ROW_ID, WEIGHT, input_column
from spark_torch_est.core.schema import INPUTS_LAYOUT, InputColumn, InputSchema
from spark_torch_est.core.spec import ColumnNames, FileSource, FilePart, How, StagedRows
from spark_torch_est.ingest.parquet_read import read_part
from spark_torch_est.ingest.staged import staged_batches, write_partition
from spark_torch_est.ingest.tables import read_rows
from spark_torch_est.scoring.inference import _evaluated
assert "pandas" not in sys.modules, "importing the rank's modules loads pandas"

rows = 6
tokens = pa.ListArray.from_arrays(from_numpy(np.array([0, 2, 3, 3, 5, 6, 8], np.int32)),
                                  from_numpy(np.arange(8, dtype=np.int64)))
validation = pa.Array.from_buffers(pa.bool_(), rows, [None, pa.py_buffer(np.packbits(np.arange(rows) % 3 == 0,
                                                                                   bitorder="little"))])
batch = pa.RecordBatch.from_arrays(
    [from_numpy(np.arange(rows, dtype=np.int64)), tokens, binary_array([b"ab"] * rows),
     from_numpy(np.ones(rows)), from_numpy(np.full(rows, 0.5, np.float32)),
     validation, from_numpy(np.arange(rows, dtype=np.int64))],
    [input_column(0), input_column(1), input_column(2), LABEL, WEIGHT, IS_VALIDATION, ROW_ID])
schema = InputSchema(INPUTS_LAYOUT, (InputColumn("user", "int64", 0, "bigint"),
                                     InputColumn("tokens", "int64", 1, "array<bigint>"),
                                     InputColumn("image", "uint8", 1, "binary")), padding_value=-1)
ingested = read_rows(iter([batch]), schema, ColumnNames(weight="w"), rows=rows)
assert len(ingested.train.labels) == 4 and len(ingested.validation.labels) == 2

directory = tempfile.mkdtemp()
assert write_partition(directory, 2, 0, iter([batch])) == rows
staged = list(staged_batches(StagedRows(directory, ((0, rows),)), 1, 2))
assert sum(b.num_rows for b in staged) == 3

path = os.path.join(directory, "t.parquet")
pq.write_table(pa.Table.from_batches([pa.RecordBatch.from_arrays(
    [from_numpy(np.ones(rows, np.float32)), from_numpy(np.ones(rows, np.float32)), from_numpy(np.ones(rows))],
    ["a", "b", "y"])]), path)
source = FileSource(outputs=((input_column(0), ("a", "b"), How.STACK), (LABEL, ("y",), How.AS_IS)),
                    parts=((FilePart(path, 0, 0, rows),),), digest="d")
assert sum(b.num_rows for b in read_part(source, 0)) == rows

_result_row(0, memoryview(b"checkpoint"))
evaluated = _evaluated(np.arange(3.0), [b"", b"state"])
assert "pandas" not in sys.modules, "a rank's ingest, staged rows, result or scoring loads pandas"
assert evaluated.to_pylist() == [{"totals": [0.0, 1.0, 2.0], "metric_states": [b"", b"state"]}]
print("ok")
"""


def test_a_ranks_path_does_not_load_pandas():
    """pyarrow's own conversions import pandas (about 0.2 s of CPU in every fresh worker); a
    rank's ingest, its staged rows, its result and the scoring outputs never need it."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_RANK_PATH)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
