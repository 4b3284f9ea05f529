"""[both] What the ranks tell the driver while a fit runs: one typed message.

Rank 0 reports its progress after a step (throttled): its position after every step, and
with the loss where the loop reads the losses; and each epoch's history entry;
every rank forwards its warning and error log records. The channel
(:mod:`spark_torch_est.cluster.channel`) carries a message as JSON (:meth:`RankMessage.to_dict`)
and the driver decodes it once, where it arrives (:meth:`RankMessage.from_dict`), so the
progress display and the loggers read typed fields and never see a malformed message::

    >>> sent = RankMessage.for_epoch({"epoch": 1, "train_loss": 0.5})
    >>> RankMessage.from_dict(sent.to_dict()) == sent
    True
    >>> RankMessage.from_dict({"type": "epoch", "entry": {"train_loss": 0.5}, "time": 0.0})
    Traceback (most recent call last):
    ...
    ValueError: not a message the driver can read (epoch): KeyError('epoch')
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from spark_torch_est.core.progress import Progress

__all__ = ["Kind", "RankMessage"]


class Kind(enum.Enum):
    """What a :class:`RankMessage` reports; its value is the ``"type"`` on the wire."""

    PROGRESS = "progress"  #: rank 0's position after a step and that step's loss
    POSITION = "position"  #: rank 0's position after a step whose loss is not read yet
    EPOCH = "epoch"  #: a completed epoch's history entry
    LOG = "log"  #: a rank's log record
    RUN_DONE = "run_done"  #: rank 0 finished one of the runs a job trains in turn; the next begins


@dataclass(frozen=True)
class RankMessage:
    """One message from a rank to the driver; the fields of another kind keep their defaults.

    Attributes:
        kind: What it reports.
        time: When the rank sent it (``time.time()`` on the rank).
        progress: ``PROGRESS``, ``POSITION``: where the run stands after the step;
            ``RUN_DONE``: where the finished run ended.
        run: ``RUN_DONE``: which of the job's runs ended (0 for its own, then
            ``TaskSpec.together``'s in order).
        steps_per_epoch: ``PROGRESS``, ``POSITION``: optimizer steps in an epoch.
        loss: ``PROGRESS``: the step's loss.
        entry: ``EPOCH``: the history entry, with its 1-based ``"epoch"``.
        rank: ``LOG``: the rank that logged the record.
        level: ``LOG``: the record's level.
        logger: ``LOG``: the name of the logger it was logged on.
        text: ``LOG``: the record's message; ``RUN_DONE``: the SHA-256 (hex) of the run's
            checkpoint rank 0 delivered over the channel, or ``""`` (it comes with the job's result).
    """

    kind: Kind
    time: float = 0.0
    progress: Progress = Progress()
    steps_per_epoch: int = 0
    loss: float = 0.0
    entry: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    run: int = 0
    level: int = logging.INFO
    logger: str = ""
    text: str = ""

    @classmethod
    def for_step(cls, progress: Progress, loss: float, steps_per_epoch: int) -> RankMessage:
        """Rank 0's position after a step, sent now."""
        return cls(Kind.PROGRESS, time.time(), progress=progress, steps_per_epoch=steps_per_epoch, loss=loss)

    @classmethod
    def for_position(cls, progress: Progress, steps_per_epoch: int) -> RankMessage:
        """Rank 0's position after a step, before its loss is read, sent now."""
        return cls(Kind.POSITION, time.time(), progress=progress, steps_per_epoch=steps_per_epoch)

    @classmethod
    def for_epoch(cls, entry: dict[str, Any]) -> RankMessage:
        """A completed epoch's history entry, sent now."""
        return cls(Kind.EPOCH, time.time(), entry=entry)

    @classmethod
    def for_run_done(cls, run: int, progress: Progress, delivered: str) -> RankMessage:
        """Rank 0 finished the job's run ``run`` (see ``TaskSpec.together``) at ``progress``;
        ``delivered``: its checkpoint's SHA-256 when the driver holds it, else ``""``."""
        return cls(Kind.RUN_DONE, time.time(), progress=progress, run=run, text=delivered)

    @classmethod
    def for_log(cls, rank: int, level: int, logger: str, text: str) -> RankMessage:
        """A log record of ``rank``, sent now."""
        return cls(Kind.LOG, time.time(), rank=rank, level=level, logger=logger, text=text)

    def to_dict(self) -> dict[str, Any]:
        """The message as plain data, as the channel sends it (numbers that hooks put in
        an epoch's entry, such as tensors, are left for the channel to turn into floats)."""
        if self.kind is Kind.PROGRESS:
            fields: dict[str, Any] = {**self.progress.to_dict(), "steps_per_epoch": self.steps_per_epoch,
                                      "loss": self.loss}
        elif self.kind is Kind.POSITION:
            fields = {**self.progress.to_dict(), "steps_per_epoch": self.steps_per_epoch}
        elif self.kind is Kind.RUN_DONE:
            fields = {**self.progress.to_dict(), "run": self.run, "sha256": self.text}
        elif self.kind is Kind.EPOCH:
            fields = {"entry": self.entry}
        else:
            fields = {"rank": self.rank, "level": self.level, "logger": self.logger, "message": self.text}
        return {"type": self.kind.value, **fields, "time": self.time}

    @classmethod
    def from_dict(cls, data: Any) -> RankMessage:
        """Decodes what :meth:`to_dict` gave, after its trip through JSON.

        Raises:
            ValueError: ``data`` is not a message of this version, or lacks a field its
                readers need.
        """
        try:
            kind, sent = Kind(data["type"]), _number(data["time"])
            if kind is Kind.PROGRESS:
                return cls(kind, sent, progress=Progress.from_dict(data),
                           steps_per_epoch=_integer(data["steps_per_epoch"]), loss=_number(data["loss"]))
            if kind is Kind.POSITION:
                return cls(kind, sent, progress=Progress.from_dict(data),
                           steps_per_epoch=_integer(data["steps_per_epoch"]))
            if kind is Kind.RUN_DONE:
                return cls(kind, sent, progress=Progress.from_dict(data), run=_integer(data["run"]),
                           text=_text(data["sha256"]))
            if kind is Kind.EPOCH:
                entry = data["entry"]
                _integer(entry["epoch"])
                return cls(kind, sent, entry=dict(entry))
            return cls(kind, sent, rank=_integer(data["rank"]), level=_integer(data["level"]),
                       logger=_text(data["logger"]), text=_text(data["message"]))
        except (KeyError, TypeError, ValueError) as error:
            kind_name = data.get("type") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a message the driver can read ({kind_name}): {error!r}") from None


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value
