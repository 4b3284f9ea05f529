import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_torch_est.data import EpochPlan, epoch_order, list_column_to_matrix, read_shard
from spark_torch_est.errors import InputDataError
from spark_torch_est.protocol import FEATURES, IS_VALIDATION, LABEL
from spark_torch_est.spec import Columns


def _batch(features, labels, flags=None):
    arrays = [pa.array(features, pa.list_(pa.float32())), pa.array(labels)]
    names = [FEATURES, LABEL]
    if flags is not None:
        arrays.append(pa.array(flags))
        names.append(IS_VALIDATION)
    return pa.RecordBatch.from_arrays(arrays, names)


def test_list_column_becomes_matrix_also_when_sliced():
    array = pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.float32()))
    np.testing.assert_array_equal(list_column_to_matrix(array.slice(1), "f"), [[3, 4], [5, 6]])


def test_ragged_rows_are_rejected_with_lengths():
    with pytest.raises(InputDataError, match="different lengths \\(1 to 2\\)"):
        list_column_to_matrix(pa.array([[1.0, 2.0], [3.0]]), "f")


def test_null_rows_and_elements_are_rejected():
    with pytest.raises(InputDataError, match="1 null rows"):
        list_column_to_matrix(pa.array([[1.0], None]), "f")
    with pytest.raises(InputDataError, match="1 null elements"):
        list_column_to_matrix(pa.array([[1.0], [None]]), "f")


def test_read_shard_concatenates_batches_and_splits_validation():
    batches = [_batch([[1, 1], [2, 2]], [1.0, 2.0], [False, True]),
               _batch([[3, 3]], [3.0], [False])]
    shard = read_shard(iter(batches))
    assert shard.features.dtype == torch.float32 and shard.features.is_contiguous()
    np.testing.assert_array_equal(shard.features.numpy(), [[1, 1], [3, 3]])
    np.testing.assert_array_equal(shard.labels.numpy(), [1.0, 3.0])
    np.testing.assert_array_equal(shard.val_features.numpy(), [[2, 2]])
    assert shard.labels.dtype == torch.float32


def test_integer_labels_become_int64_class_indices():
    shard = read_shard(iter([_batch([[1.0]], pa.array([3], pa.int64()))]))
    assert shard.labels.dtype == torch.int64


def test_null_labels_are_rejected_naming_the_column():
    with pytest.raises(InputDataError, match="'target'"):
        read_shard(iter([_batch([[1.0], [2.0]], [1.0, None])]), Columns(label="target"))


def test_ragged_features_name_the_users_column():
    with pytest.raises(InputDataError, match="column 'data' holds arrays of different lengths"):
        read_shard(iter([_batch([[1.0, 2.0], [2.0]], [1.0, 2.0])]), Columns(features="data"))


def test_epoch_order_depends_on_seed_epoch_and_rank_only():
    a = epoch_order(100, seed=1, epoch=2, rank=0)
    assert torch.equal(a, epoch_order(100, seed=1, epoch=2, rank=0))
    assert sorted(a.tolist()) == list(range(100))
    for other in (epoch_order(100, 2, 2, 0), epoch_order(100, 1, 3, 0), epoch_order(100, 1, 2, 1)):
        assert not torch.equal(a, other)


def test_an_epoch_plan_covers_the_rows_then_wraps():
    plan = EpochPlan([10, 9], batch_size=4)
    order = torch.arange(10)
    assert plan.steps == 3
    assert plan.positions(order, 0).tolist() == [0, 1, 2, 3]
    assert plan.positions(order, 2).tolist() == [8, 9]                    # the rank's own last, partial batch
    assert plan.positions(torch.arange(8), 2).tolist() == [0, 1, 2, 3]    # a shorter rank keeps stepping
    assert [plan.samples(k) for k in range(3)] == [8, 8, 3]


def test_an_epoch_plan_from_an_offset_takes_what_is_left():
    plan = EpochPlan([10, 10], batch_size=3, offset=4)
    assert plan.steps == 2 and plan.positions(torch.arange(10), 0).tolist() == [4, 5, 6]
    assert [plan.samples(k) for k in range(2)] == [6, 6]
