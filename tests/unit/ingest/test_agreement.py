"""What the ranks agree on before the first step: one layout per column, and labels shaped
to the model's output."""

import pytest
import torch

from spark_torch_est.errors import InputDataError
from spark_torch_est.ingest.agreement import LAYOUT_SIZE, agree, conform, layout, shape_labels
from spark_torch_est.ingest.columns import DenseColumn, RaggedColumn


def _layouts(*columns):
    return torch.tensor([layout(rows) for rows in columns]).reshape(-1, LAYOUT_SIZE)


def test_arrays_of_different_lengths_on_two_ranks_are_padded_per_batch_where_inputs_allow():
    short, long = DenseColumn(torch.ones(3, 2, dtype=torch.int64)), DenseColumn(torch.ones(2, 5, dtype=torch.int64))
    agreed = agree(_layouts(short, long, None), "inputCols column 'tokens'", may_be_ragged=True)
    assert agreed.row_shape is None and agreed.integer
    padded = conform(short, agreed, torch.int64, padding=0)
    assert isinstance(padded, RaggedColumn) and padded.take(torch.tensor([0])).tolist() == [[1, 1]]
    empty = conform(None, agreed, torch.int64, padding=0)
    assert isinstance(empty, RaggedColumn) and len(empty) == 0


def test_features_of_different_widths_on_two_ranks_are_refused_naming_the_column():
    layouts = _layouts(DenseColumn(torch.ones(3, 2)), DenseColumn(torch.ones(3, 4)))
    with pytest.raises(InputDataError, match="featuresCol 'f' holds rows of 2 values in some partitions and of 4"):
        agree(layouts, "featuresCol 'f'", may_be_ragged=False)


@pytest.mark.parametrize("labels, output_shape, expected_dtype, expected_shape", [
    (torch.tensor([1, 2]), [1], torch.float32, (2, 1)),      # integer labels, one output: regression
    (torch.tensor([1, 2]), [3], torch.int64, (2,)),          # integer labels, k outputs: class indices
    (torch.tensor([0.0, 2.0]), [3], torch.int64, (2,)),      # whole-number doubles (StringIndexer): the same
    (torch.tensor([1.5, 2.5]), [1], torch.float32, (2, 1)),
    (torch.tensor([1.5, 2.5]), [], torch.float32, (2,)),
    (torch.ones(2, 4), [2, 2], torch.float32, (2, 2, 2)),    # as many values per row: reshaped
])
def test_labels_take_the_outputs_shape_never_by_broadcasting(labels, output_shape, expected_dtype, expected_shape):
    shaped = shape_labels(labels, output_shape, "y")
    assert shaped.dtype == expected_dtype and tuple(shaped.shape) == expected_shape


@pytest.mark.parametrize("labels, output_shape", [(torch.tensor([1.5]), [3]), (torch.ones(2, 3), [2])])
def test_labels_that_would_broadcast_are_refused(labels, output_shape):
    with pytest.raises(InputDataError, match="labelCol 'y'"):
        shape_labels(labels, output_shape, "y")


def test_a_fractional_label_for_a_k_output_model_names_labelcol_and_the_fix():
    with pytest.raises(InputDataError, match=r"labelCol 'y' holds 1\.5, .* class index .* from 0 to 2"):
        shape_labels(torch.tensor([0.0, 1.5]), [3], "y")


def test_held_rows_laid_out_for_another_fit_that_cannot_be_read_again_are_let_go():
    """A worker's held rows, laid out by an earlier fit this one cannot use, are read again;
    when that read fails the worker holds nothing (the next fit reads), never held rows
    whose tables are gone."""
    from spark_torch_est.core.protocol import FEATURES, LABEL
    from spark_torch_est.core.ranks import Ranks
    from spark_torch_est.core.spec import FilePart, FileSource, How
    from spark_torch_est.ingest import held
    from spark_torch_est.ingest.agreement import agree_on_rows
    from spark_torch_est.ingest.tables import read_rows
    from tests.helpers import arrow_batches, task_spec

    source = FileSource(outputs=((FEATURES, ("f",), How.AS_IS), (LABEL, ("y",), How.AS_IS)),
                        parts=((FilePart("t.parquet", 0, 0, 20),),), digest="d")
    spec = task_spec(source=source)
    ingested = read_rows(iter(arrow_batches(20)), spec.schema, spec.columns)

    def gone():
        raise OSError("t.parquet: no such file")

    ingested.source, ingested.layout, ingested.reread = "files/t", "layout/1/1/of-another-fit", gone
    held.hold("files/t", ingested)
    with pytest.raises(OSError, match="no such file"):
        agree_on_rows(ingested, spec, Ranks(0, 1, torch.device("cpu")))
    assert held.held("files/t") is None
