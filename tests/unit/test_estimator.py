"""The estimator's driver-side checks that need no Spark: Params and creators."""

import pytest
import torch

from spark_torch_est import TorchEstimator
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.progress import Target
from tests.helpers import features_schema, linear_model, sgd

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
    ({"checkpointInterval": "1000sp"}, "checkpointInterval counts epochs or batches"),
    ({"minWorkers": 0}, r"minWorkers must be between 1 and numWorkers=2 \(or None for numWorkers\), got 0"),
    ({"minWorkers": 3}, r"minWorkers must be between 1 and numWorkers=2 .*got 3"),
    ({"minWorkers": 5, "numWorkers": 4}, "numWorkers=4 .*got 5"),
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
        est._spec(Target(epoch=1), features_schema(1), None, None)
