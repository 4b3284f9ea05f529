"""A rank's failure as plain data, carried to the driver inside Spark's error text.

A failing task raises :class:`RankFailure`, whose message embeds the failure as JSON
between markers, so the driver recovers rank, stage, hook and traceback from whatever
exception type Spark, Py4J or Spark Connect wraps it in. The driver turns it into the
matching :mod:`spark_torch_est.errors` class.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from spark_torch_est.errors import (
    IncompatibleCheckpointError,
    InvalidInputError,
    SparkTorchError,
    TrainingFailedError,
)

__all__ = ["Failure", "RankFailure", "USER", "INPUT", "CHECKPOINT", "SYSTEM", "UNREACHABLE"]

USER = "user"                # a hook, creator, loss or model raised: not retried
INPUT = "input"              # the rows cannot be trained on (nulls, empty partition)
CHECKPOINT = "checkpoint"    # the checkpoint does not fit the model
SYSTEM = "system"            # a collective, the network or a peer failed: retryable
UNREACHABLE = "unreachable"  # the driver's rendezvous store could not be reached

_BEGIN, _END = "<<spark_torch_est-failure ", " spark_torch_est-failure>>"
_FOUND = re.compile(re.escape(_BEGIN) + r"(\{.*?\})" + re.escape(_END), re.DOTALL)


@dataclass(frozen=True)
class Failure:
    """What went wrong on one rank.

    Attributes:
        kind: One of USER, INPUT, CHECKPOINT, SYSTEM, UNREACHABLE.
        message: ``ExceptionType: message`` of the original exception.
        rank: The rank that failed.
        stage: The loop stage (``"setup"``, ``"after_train_iter"``, ...).
        hook: The hook that raised, if any.
        traceback: The formatted remote traceback.
    """

    kind: str
    message: str
    rank: int
    stage: str
    hook: str | None = None
    traceback: str = ""

    def to_json(self) -> str:
        """Plain JSON, also used for the driver's store."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Failure:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(text))

    @classmethod
    def find(cls, text: str) -> Failure | None:
        """Finds the first embedded failure in an error text, or None."""
        match = _FOUND.search(text)
        return cls.from_json(match.group(1)) if match else None

    def marker(self) -> str:
        """The failure embedded in a line that survives Spark's error wrapping."""
        return f"{_BEGIN}{self.to_json()}{_END}"

    def to_error(self) -> SparkTorchError:
        """The driver-side exception for this failure."""
        where = f" on rank {self.rank} at {self.stage}"
        if self.kind == INPUT:
            return InvalidInputError(f"{self.message}{where}")
        if self.kind == CHECKPOINT:
            return IncompatibleCheckpointError(f"{self.message}{where}")
        origin = f"hook {self.hook!r} raised" if self.hook else "training failed"
        return TrainingFailedError(
            f"{origin}: {self.message}",
            rank=self.rank, stage=self.stage, hook=self.hook,
            remote_traceback=self.traceback or None,
            retryable=self.kind in (SYSTEM, UNREACHABLE),
        )


class RankFailure(RuntimeError):
    """Raised by a training task so that Spark fails the barrier job with a findable marker."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"rank {failure.rank} failed at {failure.stage}: {failure.message}\n{failure.marker()}")
        self.failure = failure
