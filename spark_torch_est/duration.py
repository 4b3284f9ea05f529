"""Training durations: ``"3ep"`` (epochs) or ``"500ba"`` (batches, i.e. optimizer steps).

>>> Duration.parse("3ep")
Duration(value=3, unit='ep')
>>> Duration.parse(" 150ba ")
Duration(value=150, unit='ba')
>>> str(Duration(2, "ep"))
'2ep'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from spark_torch_est.errors import InvalidInputError

__all__ = ["Duration"]

_PATTERN = re.compile(r"^\s*(\d+)\s*(ep|ba)\s*$")
_UNITS = {"ep": "epochs", "ba": "batches"}


@dataclass(frozen=True)
class Duration:
    """A positive amount of training.

    Attributes:
        value: How many units; at least 1.
        unit: ``"ep"`` for epochs or ``"ba"`` for batches (optimizer steps).
    """

    value: int
    unit: str

    def __post_init__(self) -> None:
        if self.unit not in _UNITS:
            raise InvalidInputError(f"Duration unit must be 'ep' or 'ba', got {self.unit!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, int) or self.value < 1:
            raise InvalidInputError(f"Duration value must be a positive integer, got {self.value!r}")

    @classmethod
    def parse(cls, text: str | Duration, *, what: str = "duration") -> Duration:
        """Parses ``"<n>ep"`` or ``"<n>ba"``; a Duration passes through unchanged.

        Args:
            text: The string to parse.
            what: The name of the argument or Param, used in the error message.

        Raises:
            InvalidInputError: The text is not a positive count followed by ``ep`` or ``ba``.
        """
        if isinstance(text, Duration):
            return text
        match = _PATTERN.match(text) if isinstance(text, str) else None
        if match is None or int(match.group(1)) < 1:
            raise InvalidInputError(
                f"{what} must look like '3ep' (epochs) or '500ba' (batches) with a positive "
                f"count, got {text!r}"
            )
        return cls(int(match.group(1)), match.group(2))

    def __str__(self) -> str:
        return f"{self.value}{self.unit}"
