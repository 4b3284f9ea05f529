"""[both] Training durations: ``"3ep"`` (epochs), ``"500ba"`` (batches, i.e. optimizer
steps) or ``"100000sp"`` (samples, summed over ranks); ``_`` separates digits.

>>> Duration.parse("3ep")
Duration(value=3, unit='ep')
>>> Duration.parse(" 4_000ba ")
Duration(value=4000, unit='ba')
>>> str(Duration.parse("100_000sp"))
'100000sp'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from spark_torch_est.errors import InvalidInputError

__all__ = ["Duration"]

_PATTERN = re.compile(r"^\s*(\d+(?:_\d+)*)\s*(ep|ba|sp)\s*$")
_UNITS = {"ep": "epochs", "ba": "batches", "sp": "samples"}


@dataclass(frozen=True)
class Duration:
    """A positive amount of training.

    Attributes:
        value: How many units; at least 1.
        unit: ``"ep"`` (epochs), ``"ba"`` (batches, i.e. optimizer steps) or ``"sp"``
            (samples, summed over ranks; the fit ends after the step that reaches them).
    """

    value: int
    unit: str

    def __post_init__(self) -> None:
        if self.unit not in _UNITS:
            raise InvalidInputError(f"Duration unit must be one of {', '.join(map(repr, _UNITS))}, got {self.unit!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, int) or self.value < 1:
            raise InvalidInputError(f"Duration value must be a positive integer, got {self.value!r}")

    @classmethod
    def parse(cls, text: str | Duration, *, what: str = "duration") -> Duration:
        """Parses ``"<n>ep"``, ``"<n>ba"`` or ``"<n>sp"``; a Duration passes through unchanged.

        Args:
            text: The string to parse.
            what: The name of the argument or Param, used in the error message.

        Raises:
            InvalidInputError: The text is not a positive count followed by a unit.
        """
        if isinstance(text, Duration):
            return text
        match = _PATTERN.match(text) if isinstance(text, str) else None
        if match is None or int(match.group(1)) < 1:
            raise InvalidInputError(
                f"{what} must look like '3ep' (epochs), '500ba' (batches) or '100000sp' (samples) with a positive "
                f"count ('_' may separate digits), got {text!r}"
            )
        return cls(int(match.group(1)), match.group(2))

    def __str__(self) -> str:
        return f"{self.value}{self.unit}"
