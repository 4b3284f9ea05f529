"""How far a run has come: the counters that a checkpoint carries between fits."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Progress"]


@dataclass(frozen=True)
class Progress:
    """Position in a training run.

    Attributes:
        epoch: Completed epochs.
        batch_in_epoch: Batches done in the current (incomplete) epoch; 0 at an epoch boundary.
        global_step: Optimizer steps done over the whole run.
        samples: Training samples processed over the whole run, summed over ranks.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    global_step: int = 0
    samples: int = 0

    def to_dict(self) -> dict[str, int]:
        """Returns the counters as plain data."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> Progress:
        """Builds a Progress from :meth:`to_dict` output."""
        return cls(**{k: int(data[k]) for k in ("epoch", "batch_in_epoch", "global_step", "samples")})
