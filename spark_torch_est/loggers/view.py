"""[driver] What the user sees while a fit runs: a progress bar or log lines, epoch
summaries, and the warnings the ranks log.

The view reads the same decoded messages as the loggers, but at once, on the channel's
threads: it is not queued behind the loggers' events, so a slow tracking server never
holds up the bar."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Protocol

from spark_torch_est.cluster.messages import Kind, RankMessage
from spark_torch_est.core.progress import Progress, Target
from spark_torch_est.core.running import PROGRESS_LOGGER, WORKER_LOGGER, tag
from spark_torch_est.train.metrics import format_entry

__all__ = ["DriverView"]

logger = logging.getLogger(PROGRESS_LOGGER)
worker_logger = logging.getLogger(WORKER_LOGGER)

_LOG_EVERY_S = 10.0


class _Bar(Protocol):
    """What the view uses of a tqdm bar (tqdm is optional and untyped)."""

    total: int
    n: int

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def refresh(self) -> None: ...

    def close(self) -> None: ...


class DriverView:
    """Turns the ranks' messages into a tqdm bar (interactive) or INFO log lines.

    Lines go to the ``spark_torch_est.core.progress`` logger when logging is set up (a handler
    anywhere on its way to the root logger: the program's levels then decide), else, while
    ``show``, straight to stderr: a spark-submit job or a plain script shows them without
    any setup, and nothing is shown twice. Every progress message is also a DEBUG record
    on ``spark_torch_est.core.progress`` whose ``progress`` attribute holds the message, for
    programs that follow a fit (as :meth:`RankMessage.to_dict` gives it). While more than
    one fit runs in the driver (Optuna's ``n_jobs``, a tuner's ``parallelism``), every line,
    bar and rank's log line starts with the fit's name (see :mod:`spark_torch_est.core.running`).

    Args:
        show: False logs progress at DEBUG only (the ``showProgress`` Param).
        start: Progress when the fit started.
        target: Where the fit stops.
        samples_per_step: Rows all ranks train on per step (for sample durations).
        name: The fit's name (its param map, or the start of its run id).
    """

    def __init__(self, show: bool, start: Progress, target: Target, samples_per_step: int, name: str = "") -> None:
        self.name = name
        self.show = show
        self.start = start
        self.target = target
        self.samples_per_step = samples_per_step
        self._lock = threading.Lock()
        self._bar: _Bar | None = None
        self._epoch_text = ""  # the last epoch's metrics
        self._last_line = 0.0
        self._interactive = show and _interactive()

    def handle(self, message: RankMessage) -> None:
        """Handles one message from a rank (called from channel threads)."""
        with self._lock:
            if message.kind is Kind.PROGRESS:
                self._progress(message)
            elif message.kind is Kind.EPOCH:
                self._epoch(message.entry)
            elif message.kind is Kind.LOG:
                worker_logger.log(message.level, "%s[rank %d] %s: %s", self._tag(), message.rank, message.logger,
                                  message.text)

    def _tag(self) -> str:
        """``"[name] "`` while another fit runs in this driver too, else nothing."""
        return tag(self.name)

    def _progress(self, message: RankMessage) -> None:
        at = message.progress
        logger.debug("step %d (epoch %d, batch %d/%d) loss %.4g", at.global_step, at.epoch + 1, at.batch_in_epoch,
                     message.steps_per_epoch, message.loss, extra={"progress": message.to_dict()})
        if not self.show:
            return
        total = self.target.steps_left(self.start, message.steps_per_epoch, self.samples_per_step)
        done = at.global_step - self.start.global_step
        if self._interactive:
            self._update_bar(done, total, message)
        elif time.monotonic() - self._last_line >= _LOG_EVERY_S:
            self._last_line = time.monotonic()
            self._say(f"step {done}/{total} of this fit, epoch {at.epoch + 1}, loss {message.loss:.4g}")

    def _epoch(self, entry: dict) -> None:
        self._epoch_text = f"epoch {entry['epoch']}: {format_entry(entry)}"
        if self._bar is not None:
            self._bar.set_postfix_str(self._epoch_text)
            if not logger.hasHandlers():
                return  # the bar shows it
        self._say(self._epoch_text)

    def _say(self, line: str) -> None:
        """An INFO line: through logging when it is set up, else on stderr while shown."""
        line = self._tag() + line
        if logger.hasHandlers():
            logger.info(line)
        elif self.show:
            sys.stderr.write(f"spark_torch_est: {line}\n")
            sys.stderr.flush()

    def _update_bar(self, done: int, total: int, message: RankMessage) -> None:
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is optional: fall back to log lines
            self._interactive = False
            return
        bar = self._bar
        if bar is None:
            bar = self._bar = tqdm(total=total, unit="step", desc=f"{self._tag()}training", leave=True)
        bar.total = total
        bar.n = done
        now = f"epoch {message.progress.epoch + 1}, loss {message.loss:.4g}"
        bar.set_postfix_str(f"{now} | {self._epoch_text}" if self._epoch_text else now, refresh=False)
        bar.refresh()

    def finish(self, progress: Progress, history: list[dict]) -> None:
        """After a successful fit: the bar ends at 100% with the last epoch's metrics."""
        with self._lock:
            if self._bar is not None:
                done = progress.global_step - self.start.global_step
                self._bar.total = self._bar.n = done
                if history and history[-1]["epoch"] > self.start.epoch:
                    last = f"epoch {history[-1]['epoch']}: {format_entry(history[-1])}"
                    self._bar.set_postfix_str(last, refresh=False)
                else:
                    self._bar.set_postfix_str(self._epoch_text, refresh=False)
                self._bar.refresh()

    def close(self) -> None:
        """Closes the bar."""
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


def _interactive() -> bool:
    if "ipykernel" in sys.modules:
        return True
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()

