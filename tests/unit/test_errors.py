"""The one exception tree: every error the package raises is a SparkTorchError."""

import pickle

from spark_torch_est.errors import (IncompatibleCheckpointError, InputDataError, InvalidInputError, SparkTorchError,
                                    TrainingCompleteError, TrainingFailedError)


def test_every_error_is_in_the_tree():
    for error_type in (InvalidInputError, InputDataError, TrainingCompleteError, TrainingFailedError,
                       IncompatibleCheckpointError):
        assert issubclass(error_type, SparkTorchError)
    assert issubclass(InputDataError, InvalidInputError)


def test_errors_pickle_with_their_fields():
    error = TrainingFailedError("boom", rank=1, stage="s", hook="h", remote_traceback="tb", retryable=True)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rank, copy.stage, copy.hook, copy.remote_traceback, copy.retryable) == (1, "s", "h", "tb", True)
    assert "rank=1, stage=s, hook=h" in str(copy) and "Remote traceback:\ntb" in str(copy)
