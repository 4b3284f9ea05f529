"""[driver] What the user sees while a fit runs: a progress bar or log lines, what the fit is
doing before its first step, epoch summaries, and the warnings the ranks log.

The view reads the same decoded messages as the loggers, but at once, on the channel's
threads: it is not queued behind the loggers' events, so a slow tracking server never
holds up the bar.

Its mode follows where the program runs (:func:`progress_mode`), not which modules are
imported: pyspark imports IPython and ipykernel to capture call sites, so a spark-submit job
on a machine with Jupyter installed has them too."""

from __future__ import annotations

import enum
import logging
import sys
import threading
import time
from typing import Any, Protocol

from spark_torch_est.cluster.messages import Kind, RankMessage
from spark_torch_est.core.progress import Progress, Target
from spark_torch_est.core.running import PROGRESS_LOGGER, WORKER_LOGGER, tag
from spark_torch_est.train.metrics import format_entry

__all__ = ["DriverView", "Mode", "progress_mode", "LINE_EVERY_S"]

logger = logging.getLogger(PROGRESS_LOGGER)
worker_logger = logging.getLogger(WORKER_LOGGER)

#: Seconds between progress lines in a job (stderr a file or a pipe).
LINE_EVERY_S = 10.0
#: Seconds between refreshes of a bar while nothing new arrives (its elapsed time moves on).
_TICK_S = 1.0
#: The first step's line also gives the fit's time when the phases before the launch took this long.
_EARLIER_PHASES_S = 1.0


class Mode(enum.Enum):
    """How the view shows a fit."""

    NOTEBOOK = "notebook"  #: a bar in a running Jupyter (IPython) kernel's output
    TERMINAL = "terminal"  #: a bar on a terminal's stderr
    JOB = "job"  #: a line every LINE_EVERY_S on stderr, or through logging where it is set up


def progress_mode() -> Mode:
    """Where this program runs: a notebook when an IPython kernel is running in this process
    (a shell with a kernel: Jupyter, VS Code, Colab, Databricks), a terminal when stderr is
    one, else a job. Imported modules do not count: pyspark imports IPython and ipykernel
    in every driver where they are installed."""
    if _kernel_running():
        return Mode.NOTEBOOK
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return Mode.TERMINAL if isatty is not None and isatty() else Mode.JOB
    except ValueError:  # a closed stream
        return Mode.JOB


def _kernel_running() -> bool:
    """Whether this process is an IPython kernel's (a shell with a kernel attached)."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None  # None: IPython imported, no shell
    return shell is not None and getattr(shell, "kernel", None) is not None


class _Bar(Protocol):
    """What the view uses of a tqdm bar (tqdm is optional and untyped)."""

    total: int | None
    n: int
    initial: int

    def set_description_str(self, desc: str = "", refresh: bool = True) -> None: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def update(self, n: int = 1) -> Any: ...

    def reset(self, total: int | None = None) -> None: ...

    def refresh(self) -> None: ...

    def close(self) -> None: ...


class DriverView:
    """Turns the fit's phases and the ranks' messages into a tqdm bar (notebook, terminal) or
    INFO lines (a job).

    From the call to ``fit`` on, the view says what the fit is doing (checking, launching N
    ranks and waiting for them to read their rows and meet, training), with the time spent
    in it: a bar's elapsed time moves every second, a job gets a line every
    :data:`LINE_EVERY_S` seconds. Lines go to the ``spark_torch_est.core.progress`` logger
    when logging is set up (a handler anywhere on its way to the root logger: the program's
    levels then decide), else, while ``show``, straight to stderr: a spark-submit job or a
    plain script shows them without any setup, and nothing is shown twice. Every progress
    message is also a DEBUG record on ``spark_torch_est.core.progress`` whose ``progress``
    attribute holds the message, for programs that follow a fit (as
    :meth:`RankMessage.to_dict` gives it). While more than one fit runs in the driver
    (Optuna's ``n_jobs``, a tuner's ``parallelism``), every line, bar and rank's log line
    starts with the fit's name (see :mod:`spark_torch_est.core.running`).

    Args:
        show: False logs progress at DEBUG only (the ``showProgress`` Param).
        start: Progress when the fit started (None until planned: see :meth:`planned`).
        target: Where the fit stops (None until planned).
        samples_per_step: Rows all ranks train on per step (for sample durations).
        name: The fit's name (its param map, or the start of its run id).
        mode: How to show it (None: :func:`progress_mode`).
    """

    def __init__(self, show: bool, start: Progress | None, target: Target | None, samples_per_step: int,
                 name: str = "", mode: Mode | None = None) -> None:
        self.name = name
        self.show = show
        self.start = start or Progress()
        self.target = target or Target(epoch=self.start.epoch + 1)
        self.samples_per_step = samples_per_step
        self.mode = mode or progress_mode()
        self._lock = threading.Lock()
        self._bar: _Bar | None = None
        self._epoch_text = ""  # the last epoch's metrics
        self._step_text = ""  # the last step's position and loss
        self._loss: float | None = None
        self._phase = ""
        self._phase_since = self._began = time.monotonic()
        self._training = False
        self._last_line = 0.0
        self._closed = threading.Event()
        self._ticker: threading.Thread | None = None

    @property
    def _bars(self) -> bool:
        return self.show and self.mode is not Mode.JOB

    # --------------------------------------------------------------- fit's phases

    def planned(self, start: Progress, target: Target) -> None:
        """The fit's start and target, once planned."""
        with self._lock:
            self.start, self.target = start, target

    def phase(self, text: str) -> None:
        """Says what the fit does now (``"launching 2 ranks"``), at once, and keeps saying
        it with the time spent until the next phase or the first step."""
        with self._lock:
            self._phase, self._phase_since = text, time.monotonic()
            if self._bars:
                bar = self._open_bar()
                if bar is not None:
                    bar.set_description_str(f"{self._tag()}{text}", refresh=True)
            else:
                self._line(f"{text} ...")
        if self.show and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="spark_torch_est-view", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        """Until closed: a bar's elapsed time moves on, a job's line comes every LINE_EVERY_S."""
        every = _TICK_S if self._bars else min(_TICK_S, LINE_EVERY_S)
        while not self._closed.wait(every):
            with self._lock:
                if self._closed.is_set():
                    return
                if self._bar is not None:
                    self._bar.refresh()
                elif not self._training and time.monotonic() - self._last_line >= LINE_EVERY_S:
                    self._line(f"{self._phase} ({time.monotonic() - self._phase_since:.0f}s)")
                elif self._step_text and time.monotonic() - self._last_line >= LINE_EVERY_S:
                    self._line(self._step_text)  # steps went on, no message came at its time

    # ------------------------------------------------------------ ranks' messages

    def handle(self, message: RankMessage) -> None:
        """Handles one message from a rank (called from channel threads)."""
        with self._lock:
            if self._closed.is_set() and message.kind is not Kind.LOG:
                return  # a late message after the fit: no new bar
            if message.kind is Kind.PROGRESS:
                self._progress(message, message.loss)
            elif message.kind is Kind.POSITION:
                self._progress(message, None)
            elif message.kind is Kind.EPOCH:
                self._epoch(message.entry)
            elif message.kind is Kind.LOG:
                worker_logger.log(message.level, "%s[rank %d] %s: %s", self._tag(), message.rank, message.logger,
                                  message.text)

    def _tag(self) -> str:
        """``"[name] "`` while another fit runs in this driver too, else nothing."""
        return tag(self.name)

    def _progress(self, message: RankMessage, loss: float | None) -> None:
        at = message.progress
        if loss is not None:
            self._loss = loss
            logger.debug("step %d (epoch %d, batch %d/%d) loss %.4g", at.global_step, at.epoch + 1, at.batch_in_epoch,
                         message.steps_per_epoch, loss, extra={"progress": message.to_dict()})
        if not self.show:
            return
        total = self.target.steps_left(self.start, message.steps_per_epoch, self.samples_per_step)
        done = at.global_step - self.start.global_step
        now = f"epoch {at.epoch + 1}" + (f", loss {self._loss:.4g}" if self._loss is not None else "")
        self._step_text = f"step {done}/{total} of this fit, {now}"
        first = not self._training
        self._training = True
        if self._bars:
            self._update_bar(done, total, now, first)
        elif first:
            self._line(f"first step after {self._first_step_time()}; {self._step_text}")
            self._step_text = ""
        elif time.monotonic() - self._last_line >= LINE_EVERY_S:
            self._line(self._step_text)

    def _first_step_time(self) -> str:
        """The launch's time to the first step (from its phase's line), and the whole fit's
        where the phases before it (the checks, a staging job) took a second or more."""
        now = time.monotonic()
        launch, fit = now - self._phase_since, now - self._began
        return f"{launch:.1f}s" + (f" ({fit:.1f}s since the fit began)" if fit - launch >= _EARLIER_PHASES_S else "")

    def _epoch(self, entry: dict) -> None:
        self._epoch_text = f"epoch {entry['epoch']}: {format_entry(entry)}"
        self._step_text = ""  # older than the epoch's line
        if self._bar is not None:
            self._bar.set_postfix_str(self._epoch_text)
            if not logger.hasHandlers():
                return  # the bar shows it
        self._say(self._epoch_text)

    def _line(self, line: str) -> None:
        """A progress line (a job's), counted for the next one's time; a step's line once."""
        self._last_line = time.monotonic()
        if line == self._step_text:
            self._step_text = ""
        self._say(line)

    def _say(self, line: str) -> None:
        """An INFO line: through logging when it is set up, else on stderr while shown."""
        line = self._tag() + line
        if logger.hasHandlers():
            logger.info(line)
        elif self.show:
            sys.stderr.write(f"spark_torch_est: {line}\n")
            sys.stderr.flush()

    def _open_bar(self) -> _Bar | None:
        """The fit's bar, made at its first phase; None without tqdm (lines instead)."""
        if self._bar is None:
            self._bar = _make_bar(self.mode, f"{self._tag()}{self._phase}")
            if self._bar is None:
                self.mode = Mode.JOB
        return self._bar

    def _update_bar(self, done: int, total: int, now: str, first: bool) -> None:
        bar = self._open_bar()
        if bar is None:
            self._line(self._step_text)
            return
        if first:  # the bar's clock and count start at the first step: a true rate from there
            bar.reset(total=total)
            bar.initial = bar.n = done
            bar.set_description_str(f"{self._tag()}training", refresh=False)
        else:
            bar.total = total
            bar.update(done - bar.n)
        bar.set_postfix_str(f"{now} | {self._epoch_text}" if self._epoch_text else now, refresh=False)
        bar.refresh()

    def finish(self, progress: Progress, history: list[dict]) -> None:
        """After a successful fit: the bar ends at 100% with the last epoch's metrics."""
        with self._lock:
            if self._bar is not None:
                done = progress.global_step - self.start.global_step
                self._bar.total = done
                self._bar.update(done - self._bar.n)
                self._bar.set_description_str(f"{self._tag()}training", refresh=False)
                if history and history[-1]["epoch"] > self.start.epoch:
                    last = f"epoch {history[-1]['epoch']}: {format_entry(history[-1])}"
                    self._bar.set_postfix_str(last, refresh=False)
                else:
                    self._bar.set_postfix_str(self._epoch_text, refresh=False)
                self._bar.refresh()

    def close(self) -> None:
        """Closes the bar and stops the ticker."""
        self._closed.set()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        ticker = self._ticker
        if ticker is not None and ticker is not threading.current_thread():
            ticker.join(timeout=2 * _TICK_S)


def _make_bar(mode: Mode, description: str) -> _Bar | None:
    """A tqdm bar on stderr: a widget in a notebook with ipywidgets, a text bar in one without
    (tqdm.auto would warn ``IProgress not found``) and on a terminal; None without tqdm."""
    try:
        from tqdm.std import tqdm
    except ImportError:  # tqdm is optional: lines instead
        return None
    kind: Any = tqdm
    if mode is Mode.NOTEBOOK:
        try:
            import ipywidgets  # noqa: F401 - only whether it is there
            from tqdm.notebook import tqdm as notebook_tqdm
            kind = notebook_tqdm
        except ImportError:
            pass
    options: dict[str, Any] = {"file": sys.stderr, "dynamic_ncols": True} if kind is tqdm else {}
    bar: _Bar = kind(total=None, unit="step", desc=description, leave=True, **options)
    return bar
