"""The one exception tree: every error the package raises is a SparkTorchError."""

import pickle

from spark_torch_est.errors import (
    IncompatibleCheckpointError,
    InputDataError,
    InvalidInputError,
    SparkTorchError,
    TrainingCompleteError,
    TrainingFailedError,
    UserCodeError,
    described,
)


def test_every_error_is_in_the_tree():
    for error_type in (InvalidInputError, InputDataError, TrainingCompleteError, TrainingFailedError,
                       IncompatibleCheckpointError, UserCodeError):
        assert issubclass(error_type, SparkTorchError)
    assert issubclass(InputDataError, InvalidInputError)


def test_errors_pickle_with_their_fields():
    error = TrainingFailedError("boom", rank=1, stage="s", hook="h", remote_traceback="tb", retryable=True)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rank, copy.stage, copy.hook, copy.remote_traceback, copy.retryable) == (1, "s", "h", "tb", True)
    assert "rank=1, stage=s, hook=h" in str(copy)


_REMOTE = """Traceback (most recent call last):
  File "/x/site-packages/spark_torch_est/train/loop.py", line 319, in _train_step
    self._call("after_train_iter", batch_idx, **step)
  File "/x/site-packages/spark_torch_est/train/hooks.py", line 199, in <lambda>
    return lambda context: method(context[key])
                           ^^^^^^^^^^^^^^^^^^^^
  File "/home/me/train.py", line 8, in after_train_iter
    raise ValueError("boom")
ValueError: boom
"""


def test_the_message_shows_the_users_frames_and_keeps_the_whole_remote_traceback():
    error = TrainingFailedError("hook 'H' raised: ValueError: boom", rank=0, stage="after_train_iter", hook="H",
                                remote_traceback=_REMOTE)
    assert str(error).splitlines()[2:] == [
        "Remote traceback, your code's frames (all of it: .remote_traceback):",
        "Traceback (most recent call last):",
        '  File "/home/me/train.py", line 8, in after_train_iter',
        '    raise ValueError("boom")',
        "ValueError: boom",
    ]
    assert error.remote_traceback == _REMOTE
    assert "\n\n" not in str(TrainingFailedError("x", remote_traceback="no Python traceback in here"))


def test_what_user_code_returned_is_told_by_kind_and_shape_never_by_a_tensors_values():
    import torch

    assert described(True) == "bool True" and described(None) == "None" and described("no") == "str 'no'"
    assert described((torch.zeros(2, 1), 3)) == "a tuple of 2 (a Tensor of shape [2, 1], int 3)"
    assert described({"logits": 1, "loss": 2}) == "a dict with keys 'logits', 'loss'"
    assert described(object()) == "an object" and described(list(range(9))).endswith("int 3, ...)")
    error = UserCodeError.returned("metric 'acc'", {"a": 1}, "a number", "return one")
    assert str(error) == "metric 'acc' returned a dict with keys 'a'; expected a number: return one"
