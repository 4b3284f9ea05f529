"""[executor] What the loop tells the driver while it trains, as an interface: the cluster side
implements it over the channel (:class:`~spark_torch_est.cluster.channel.ProgressReporter`), so
the loop never imports the network."""

from __future__ import annotations

import logging
from typing import Protocol

from spark_torch_est.core.progress import Progress

__all__ = ["Reporter", "SILENT"]


class Reporter(Protocol):
    """Rank 0's reports to the driver; every method is a no-op where nothing listens."""

    def step(self, progress: Progress, loss: float, steps_per_epoch: int) -> None:
        """The position after a step and that step's loss, as the loop reads them: every few
        steps (see :data:`spark_torch_est.train.step.READ_EVERY`), never a tensor the call
        would have to wait for; the implementation may send fewer."""

    def position(self, progress: Progress, steps_per_epoch: int) -> None:
        """The position after every step, without its loss (not read yet): the
        implementation sends the first at once (the fit's first step) and then a few a second
        at most, so the driver's view moves while steps run between readings."""

    def epoch(self, entry: dict) -> None:
        """A finished epoch's history entry."""

    def stop_asked(self, epoch: int, wait: float) -> bool:
        """Whether the driver's loggers ask the fit to stop at the end of ``epoch``."""

    def note(self, logger_name: str, message: str, level: int = logging.INFO) -> None:
        """Logs ``message`` at ``level`` on the driver, once."""


class _Silent:
    """Reports nothing: a loop run without a driver (tests, a rank without a channel)."""

    def step(self, progress: Progress, loss: float, steps_per_epoch: int) -> None:
        pass

    def position(self, progress: Progress, steps_per_epoch: int) -> None:
        pass

    def epoch(self, entry: dict) -> None:
        pass

    def stop_asked(self, epoch: int, wait: float) -> bool:
        return False

    def note(self, logger_name: str, message: str, level: int = logging.INFO) -> None:
        pass


SILENT: Reporter = _Silent()
