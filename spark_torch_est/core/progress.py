"""[both] How far a run has come (:class:`Progress`), where a fit stops (:class:`Target`),
when a periodic checkpoint is due (:class:`Interval`) and where a branch began (:class:`Parent`).

Progress is immutable and advanced by methods, never rebuilt by hand::

    >>> p = Progress().to_next_batch(samples=128)
    >>> p
    Progress(epoch=0, batch_in_epoch=1, global_step=1, samples=128, sample_in_epoch=128)
    >>> p.to_next_epoch()
    Progress(epoch=1, batch_in_epoch=0, global_step=1, samples=128, sample_in_epoch=0)

A Target is the one home of the stop rule::

    >>> target = Target.after(Progress(epoch=1), Duration.parse("2ep"), max_epochs=2)
    >>> target.epoch, target.reached(Progress(epoch=2))
    (2, True)

An Interval is the one home of the checkpoint rule::

    >>> every = Interval.parse("2ep")
    >>> every.due(Progress(epoch=4), "ep"), every.due(Progress(epoch=3), "ep"), every.due(Progress(epoch=4), "ba")
    (True, False, False)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

from spark_torch_est.core.duration import Duration
from spark_torch_est.errors import InvalidInputError, TrainingCompleteError

__all__ = ["Progress", "Target", "Interval", "Parent"]


@dataclass(frozen=True)
class Progress:
    """Position in a training run.

    Attributes:
        epoch: Completed epochs.
        batch_in_epoch: Optimizer steps done in the current (incomplete) epoch; 0 at an
            epoch boundary.
        global_step: Optimizer steps done over the whole run.
        samples: Training samples processed over the whole run, summed over ranks.
        sample_in_epoch: Training samples processed in the current epoch, summed over
            ranks: where the epoch continues, whatever the batch size of the next fit.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    global_step: int = 0
    samples: int = 0
    sample_in_epoch: int = 0

    def to_next_batch(self, samples: int) -> Progress:
        """The progress after one more optimizer step over ``samples`` rows (all ranks)."""
        return replace(self, batch_in_epoch=self.batch_in_epoch + 1, global_step=self.global_step + 1,
                       samples=self.samples + samples, sample_in_epoch=self.sample_in_epoch + samples)

    def to_next_epoch(self) -> Progress:
        """The progress once the current epoch is complete."""
        return replace(self, epoch=self.epoch + 1, batch_in_epoch=0, sample_in_epoch=0)

    def to_dict(self) -> dict[str, int]:
        """Returns the counters as plain data."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, int]) -> Progress:
        """Builds a Progress from :meth:`to_dict` output (other keys are ignored).

        Raises:
            KeyError: A counter is missing.
        """
        return cls(**{name: int(data[name]) for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Target:
    """Where a fit stops, as absolute counters, so a relaunched job does the same work.

    Attributes:
        epoch: Stop once this many epochs are complete (never more than ``maxEpochs``).
        global_step: Stop once this many optimizer steps are done, or None.
        samples: Stop once this many samples are done (after the step that reaches it), or None.
    """

    epoch: int
    global_step: int | None = None
    samples: int | None = None

    @classmethod
    def after(cls, progress: Progress, duration: Duration | None, max_epochs: int) -> Target:
        """The target of a fit that starts at ``progress`` and trains ``duration`` more
        (None: to ``max_epochs``), never past ``max_epochs``.

        Raises:
            TrainingCompleteError: ``progress`` is already at ``max_epochs``.
        """
        if progress.epoch >= max_epochs:
            raise TrainingCompleteError(
                f"the run is complete: {progress.epoch} of maxEpochs={max_epochs} epochs are done. "
                "Raise maxEpochs (est.setMaxEpochs(n)) to train further, or call est.reset() to start a new run"
            )
        if duration is None:
            return cls(epoch=max_epochs)
        if duration.unit == "ep":
            return cls(epoch=min(progress.epoch + duration.value, max_epochs))
        if duration.unit == "ba":
            return cls(epoch=max_epochs, global_step=progress.global_step + duration.value)
        return cls(epoch=max_epochs, samples=progress.samples + duration.value)

    def reached(self, progress: Progress) -> bool:
        """Whether a run at ``progress`` has done this fit's work."""
        return (progress.epoch >= self.epoch
                or (self.global_step is not None and progress.global_step >= self.global_step)
                or (self.samples is not None and progress.samples >= self.samples))

    def steps_left(self, progress: Progress, steps_per_epoch: int, samples_per_step: int) -> int:
        """Optimizer steps from ``progress`` to this target (an estimate where the batch
        size changed mid-epoch)."""
        steps = max((self.epoch - progress.epoch) * steps_per_epoch - progress.batch_in_epoch, 0)
        if self.global_step is not None:
            steps = min(steps, self.global_step - progress.global_step)
        if self.samples is not None and samples_per_step > 0:
            steps = min(steps, math.ceil((self.samples - progress.samples) / samples_per_step))
        return max(steps, 0)


@dataclass(frozen=True)
class Interval:
    """How often a fit writes a periodic checkpoint (``checkpointInterval``): every
    ``count`` completed epochs, or every ``count`` optimizer steps of the run.

    Attributes:
        count: Epochs or steps between checkpoints.
        unit: ``"ep"`` or ``"ba"``.
    """

    count: int
    unit: str

    @classmethod
    def parse(cls, text: str) -> Interval:
        """The interval a ``checkpointInterval`` string names.

        Raises:
            InvalidInputError: Not a duration, or one counted in samples.
        """
        duration = Duration.parse(text, what="checkpointInterval")
        if duration.unit not in ("ep", "ba"):
            raise InvalidInputError(f"checkpointInterval counts epochs or batches ('1ep', '500ba'), got {text!r}")
        return cls(duration.value, duration.unit)

    def due(self, progress: Progress, unit: str) -> bool:
        """Whether a checkpoint is due at ``progress``, just after the end of one ``unit``
        (``"ep"``: an epoch, ``"ba"``: an optimizer step)."""
        count = progress.epoch if unit == "ep" else progress.global_step
        return unit == self.unit and count % self.count == 0


@dataclass(frozen=True)
class Parent:
    """The point a run branched from: another run's, or an earlier one of the same run.

    Attributes:
        run_id: The run branched from.
        global_step: Its optimizer steps at the point branched from.
    """

    run_id: str
    global_step: int

    def __str__(self) -> str:
        """``<run id's first 12 characters>@<global step>``, as the history records it."""
        return f"{self.run_id[:12]}@{self.global_step}"
