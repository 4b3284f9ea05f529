"""Driver-side checks that need no Spark: schemas, Params and creators."""

import pytest
import torch
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import types as T

from spark_torch_est import TorchEstimator
from spark_torch_est.errors import InvalidInputError, TrainingCompleteError
from spark_torch_est.frames import check_validation_col, features_kind, label_kind
from spark_torch_est.progress import Progress
from tests.helpers import linear_model, sgd

SCHEMA = T.StructType([
    T.StructField("vec", VectorUDT()), T.StructField("arr", T.ArrayType(T.DoubleType())),
    T.StructField("x", T.DoubleType()), T.StructField("n", T.IntegerType()),
    T.StructField("name", T.StringType()), T.StructField("flag", T.BooleanType()),
    T.StructField("words", T.ArrayType(T.StringType())),
])


def test_feature_layouts_are_recognized():
    assert features_kind(SCHEMA, "vec", None) == "vector"
    assert features_kind(SCHEMA, "arr", None) == "array"
    assert features_kind(SCHEMA, "x", None) == "scalar"
    assert features_kind(SCHEMA, None, ["x", "n", "flag"]) == "columns"


@pytest.mark.parametrize("features_col, feature_cols, message", [
    ("missing", None, "featuresCol='missing': no such column; the DataFrame has vec, arr"),
    ("name", None, "featuresCol='name' has type string"),
    ("words", None, "array<string>"),
    (None, ["x", "name"], "featureCols: column 'name' has type string"),
    (None, [], "empty list"),
    (None, None, "set featuresCol"),
])
def test_bad_feature_columns_are_explained(features_col, feature_cols, message):
    with pytest.raises(InvalidInputError, match=message.replace("(", "\\(").replace(")", "\\)")):
        features_kind(SCHEMA, features_col, feature_cols)


def test_label_kinds_and_errors():
    assert label_kind(SCHEMA, "n") == "long"
    assert label_kind(SCHEMA, "x") == "float"
    assert label_kind(SCHEMA, "arr") == "array"
    with pytest.raises(InvalidInputError, match="labelCol='name'"):
        label_kind(SCHEMA, "name")
    with pytest.raises(InvalidInputError, match="labelCol='y': no such column"):
        label_kind(SCHEMA, "y")
    with pytest.raises(InvalidInputError, match="must be boolean"):
        check_validation_col(SCHEMA, "x")


def _est(**kw):
    settings = dict(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss())
    settings.update(kw)
    return TorchEstimator(**settings)


@pytest.mark.parametrize("params, message", [
    ({"batchSize": 0}, "batchSize must be at least 1, got 0"),
    ({"maxEpochs": 0}, "maxEpochs must be at least 1"),
    ({"numWorkers": -1}, "numWorkers must be at least 1"),
    ({"maxRetries": -1}, "maxRetries must be at least 0"),
    ({"timeout": 0.0}, "timeout must be a positive"),
    ({"checkpointInterval": "often"}, "checkpointInterval must look like"),
])
def test_params_out_of_range(params, message):
    with pytest.raises(InvalidInputError, match=message):
        _est(**params)._check_params()


def test_param_accessors_and_copy_keep_values():
    est = _est(batchSize=32, maxEpochs=3)
    assert (est.getBatchSize(), est.getMaxEpochs(), est.getNumWorkers()) == (32, 3, 2)
    est.setBatchSize(8)
    copied = est.copy({est.maxEpochs: 9})
    assert (copied.getBatchSize(), copied.getMaxEpochs(), est.getMaxEpochs()) == (8, 9, 3)


@pytest.mark.parametrize("creators, message", [
    ({"model": lambda c: "not a module"}, "returned str, not a torch.nn.Module"),
    ({"model": lambda c: 1 / 0}, "model creator raised ZeroDivisionError"),
    ({"optimizer": lambda m, c: None}, "not a torch.optim.Optimizer"),
    ({"scheduler": lambda o, c: object()}, "no step\\(\\)/state_dict\\(\\)"),
    ({"loss": None}, "needs loss"),
])
def test_bad_creators_fail_on_the_driver(creators, message):
    with pytest.raises(InvalidInputError, match=message):
        _est(**creators)._check_creators(None)


def test_unpicklable_creators_are_reported():
    import threading

    lock = threading.Lock()
    est = _est(model=lambda c: (lock, torch.nn.Linear(1, 1))[1])
    with pytest.raises(InvalidInputError, match="cannot be pickled"):
        est._spec(est._target(Progress(), None), None)


def test_target_caps_at_max_epochs_and_complete_runs_refuse():
    est = _est(maxEpochs=5)
    assert est._target(Progress(epoch=4), "3ep").epoch == 5
    steps = est._target(Progress(epoch=1, global_step=40), "150ba")
    assert (steps.global_step, steps.epoch) == (190, 5)
    with pytest.raises(TrainingCompleteError, match="reset\\(\\)"):
        est._target(Progress(epoch=5), None)
