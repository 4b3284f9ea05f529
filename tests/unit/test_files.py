"""A rank's part of a Parquet table, read with pyarrow as training-frame batches."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from spark_torch_est.files import read_part
from spark_torch_est.protocol import FEATURES, LABEL, input_column
from spark_torch_est.spec import FilePart, FileSource


def _table(path, rows=100, group=30):
    x = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3)
    table = pa.table({"a": x[:, 0], "b": x[:, 1], "v": pa.array(list(x), pa.list_(pa.float64())),
                      "y": np.arange(rows)})
    pq.write_table(table, path, row_group_size=group)


def test_a_part_reads_exactly_its_rows_across_row_groups(tmp_path):
    path = str(tmp_path / "t.parquet")
    _table(path)
    parts = ((FilePart(path, 1, 10, 30), FilePart(path, 2, 0, 5)),)  # rows 40..59 and 60..64
    source = FileSource(outputs=((input_column(0), ("v",), "as_is"), (LABEL, ("y",), "as_is")), parts=parts,
                        digest="d")
    batches = list(read_part(source, 0, batch_rows=7))
    labels = np.concatenate([b.column(LABEL).to_numpy() for b in batches])
    assert labels.tolist() == list(range(40, 60)) + list(range(60, 65))
    assert batches[0].schema.names == [input_column(0), LABEL]


def test_numeric_columns_are_stacked_or_wrapped_as_the_frame_would(tmp_path):
    path = str(tmp_path / "t.parquet")
    _table(path, rows=4, group=4)
    source = FileSource(outputs=((FEATURES, ("a", "b"), "stack"), (LABEL, ("y",), "as_is")),
                        parts=((FilePart(path, 0, 0, 4),),), digest="d")
    (batch,) = read_part(source, 0)
    assert batch.column(FEATURES).to_pylist() == [[0.0, 1.0], [3.0, 4.0], [6.0, 7.0], [9.0, 10.0]]
    source = FileSource(outputs=((FEATURES, ("a",), "wrap"), (LABEL, ("y",), "as_is")),
                        parts=((FilePart(path, 0, 1, 3),),), digest="d")
    (batch,) = read_part(source, 0)
    assert batch.column(FEATURES).to_pylist() == [[3.0], [6.0]]
