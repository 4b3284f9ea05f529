"""Follows a ``TorchEstimator`` fit from the driver, with no hook on the ranks.

``spark_torch_est`` logs every progress message from rank 0 as a DEBUG record on the
``spark_torch_est.progress`` logger, with the message (rank 0's ``time.time()``,
``global_step``, ``samples``) in the record's ``progress`` attribute. Rank 0 sends one
after its first step and then at most every 0.5 s, so the records time the loop of a fit
that has no hooks at all.
"""

from __future__ import annotations

import logging

__all__ = ["ProgressRecords"]

_LOGGER = "spark_torch_est.progress"


class ProgressRecords(logging.Handler):
    """Collects the progress messages of the fits run inside ``with ProgressRecords():``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[dict] = []
        self._logger = logging.getLogger(_LOGGER)
        self._level = self._logger.level

    def __enter__(self) -> ProgressRecords:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)

    def emit(self, record: logging.LogRecord) -> None:
        message = getattr(record, "progress", None)
        if message is not None:
            self.messages.append(message)

    def loop_figures(self, called: float) -> dict[str, float | None]:
        """``first_step_s`` after ``called`` (the driver's ``time.time()`` at the call) and
        ``samples_per_s`` between the first and the last message."""
        if not self.messages:
            return {"first_step_s": None, "samples_per_s": None}
        first, last = self.messages[0], self.messages[-1]
        seconds = last["time"] - first["time"]
        return {
            "first_step_s": first["time"] - called if first["global_step"] == 1 else None,
            "samples_per_s": (last["samples"] - first["samples"]) / seconds if seconds > 0 else None,
            "loop_samples": last["samples"] - first["samples"],
        }
