"""[both] The exception hierarchy: every error the package raises is a :class:`SparkTorchError`."""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "SparkTorchError",
    "InvalidInputError",
    "TrainingCompleteError",
    "TrainingFailedError",
    "IncompatibleCheckpointError",
    "InputDataError",
    "UserCodeError",
]


class SparkTorchError(Exception):
    """Base class of every error raised by spark_torch_est."""


class InvalidInputError(SparkTorchError, ValueError):
    """A DataFrame, Param or creator is unusable; raised on the driver before any job."""


class InputDataError(InvalidInputError):
    """The rows of a partition cannot be trained on (nulls, ragged arrays, no rows): found
    by the tasks, which only see the data, and raised on the driver as the fit's error."""


class UserCodeError(SparkTorchError):
    """The user's code (a creator, the model's forward, the loss, a metric, a hook) returned a
    value the package cannot take. The message names the object, what it returned and what
    was expected; raised on a rank, it fails the fit without a retry (it would return the
    same again)."""

    @classmethod
    def returned(cls, owner: str, value: Any, expected: str, fix: str = "") -> UserCodeError:
        """The error of ``owner`` (``"hook 'clip' (Clip).before_backward()"``) having returned
        ``value`` where ``expected`` was due; ``fix`` says what to change."""
        return cls(f"{owner} returned {described(value)}; expected {expected}" + (f": {fix}" if fix else ""))


def described(value: Any, depth: int = 0) -> str:
    """A short account of ``value`` for an error message: its type and, for a tensor or an
    array, its shape (never its values: reading a device tensor would wait for the device),
    for a sequence or a mapping its length and first items or keys."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, type):
        return f"a {type(value).__name__} of shape {list(shape)}"
    if isinstance(value, (tuple, list)) and depth == 0:
        items = ", ".join(described(item, 1) for item in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"a {type(value).__name__} of {len(value)} ({items})"
    if isinstance(value, dict) and depth == 0:
        keys = ", ".join(repr(key)[:40] for key in list(value)[:6]) + (", ..." if len(value) > 6 else "")
        return f"a {type(value).__name__} with keys {keys}" if value else f"an empty {type(value).__name__}"
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        text = repr(value)
        return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}" if value is not None else "None"
    module, name = type(value).__module__, type(value).__qualname__
    name = name if module == "builtins" else f"{module}.{name}"
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class TrainingCompleteError(SparkTorchError):
    """``fit()`` was asked to train a run that has already reached ``maxEpochs``."""


class IncompatibleCheckpointError(SparkTorchError):
    """A checkpoint does not fit the model it should be loaded into."""


class TrainingFailedError(SparkTorchError):
    """A training task failed.

    Attributes:
        rank: The rank that failed first, or None when Spark gave no rank.
        stage: Where it failed (``"rendezvous"``, ``"setup"``, a hook stage such as
            ``"after_train_iter"``, ``"train_step"``, ...), or None.
        hook: The name of the hook that raised, or None.
        remote_traceback: The traceback text from the executor, or None.
        retryable: Whether a relaunch from a checkpoint may succeed.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        stage: str | None = None,
        hook: str | None = None,
        remote_traceback: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.rank = rank
        self.stage = stage
        self.hook = hook
        self.remote_traceback = remote_traceback
        self.retryable = retryable

    def __reduce__(self):  # keyword-only arguments need an explicit pickle recipe
        return (_rebuild_training_failed, (self.message, self.__dict__.copy()))

    def __str__(self) -> str:
        where = [f"{k}={v}" for k, v in (("rank", self.rank), ("stage", self.stage),
                                         ("hook", self.hook)) if v is not None]
        text = f"{self.message} ({', '.join(where)})" if where else self.message
        frames = _user_frames(self.remote_traceback or "")
        if frames:
            text += "\n\nRemote traceback, your code's frames (all of it: .remote_traceback):\n" + frames
        return text


_FRAME = re.compile(r'  File "(?P<path>[^"\n]{0,4096})", line \d+')  # matched at a line's start
#: The line that starts a Python traceback.
TRACEBACK = "Traceback (most recent call last):"


def frame_path(line: str) -> str | None:
    """The file of a traceback's frame line (``  File "/x/job.py", line 6, in f``), else None."""
    frame = _FRAME.match(line)
    return frame["path"] if frame else None


def frame_kind(path: str) -> str:
    """Whose code a traceback's frame at ``path`` (as an executor printed it) runs:
    ``"package"`` (this package's, installed or shipped in a zip), ``"runtime"`` (PySpark's
    worker, Python's import machinery) or ``"user"`` (the user's code, a library it called,
    a notebook cell)."""
    if path.startswith("<frozen "):
        return "runtime"
    folders = re.split(r"[/\\]", path)[:-1]
    if "spark_torch_est" in folders:
        return "package"
    if "pyspark" in folders or any(folder.endswith("pyspark.zip") for folder in folders):
        return "runtime"
    return "user"


def _user_frames(text: str, limit: int = 30) -> str:
    """The last Python traceback in ``text`` without this package's own frames: the
    frames of the user's code (and the libraries it called) and the exception line, at
    most ``limit`` lines; ``""`` when ``text`` holds no Python traceback."""
    start = text.rfind(TRACEBACK)
    if start < 0:
        return ""
    kept: list[str] = []
    skipping = False
    for line in text[start:].splitlines():
        path = frame_path(line)
        if path is not None:
            skipping = frame_kind(path) == "package"
        elif not line.startswith("    "):  # the exception, or what Spark wrapped around it
            skipping = line.startswith(("\tat ", " SQLSTATE"))
        if not skipping:
            kept.append(line)
    return "\n".join(kept[:limit]).rstrip()


def _rebuild_training_failed(message: str, attrs: dict) -> TrainingFailedError:
    error = TrainingFailedError(message)
    error.__dict__.update(attrs)
    return error
