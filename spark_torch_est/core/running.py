"""[both] Which fits run in this driver now, and the name that tells their lines apart.

Optuna's ``n_jobs``, a tuner's ``parallelism`` or two notebook cells can run fits at once in
one driver; their progress lines and log records would interleave with nothing saying
whose they are. While more than one fit runs, every line of the driver view and every
record logged through :func:`fit_logger` in a fit's thread starts with ``[<fit's name>]``;
with one fit, lines stay as they are.

The loggers users configure have fixed names, declared here and nowhere else, that do not
move with the modules (progress and worker are the names of 0.1.0): see
docs/reliability.md, "The driver's view".
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, MutableMapping
from contextvars import ContextVar
from typing import Any

__all__ = ["PROGRESS_LOGGER", "WORKER_LOGGER", "FIT_LOGGER", "running_fit", "tag", "fit_logger"]

#: Progress and epoch lines (INFO), and every progress message (DEBUG, in the record's ``progress``).
PROGRESS_LOGGER = "spark_torch_est.progress"
#: The ranks' log records, forwarded to the driver as ``[rank N] logger: message``.
WORKER_LOGGER = "spark_torch_est.worker"
#: The fit's own log on the driver: its jobs, each relaunch and why, the failure policy's
#: decisions, the rows kept between fits, the fit's end.
FIT_LOGGER = "spark_torch_est.fit"

_CURRENT: ContextVar[str | None] = ContextVar("spark_torch_est_fit", default=None)
_RUNNING: list[str] = []
_LOCK = threading.Lock()


@contextlib.contextmanager
def running_fit(name: str) -> Iterator[None]:
    """Counts a fit as running, under ``name``, in this thread and while the block runs."""
    with _LOCK:
        _RUNNING.append(name)
    token = _CURRENT.set(name)
    try:
        yield
    finally:
        _CURRENT.reset(token)
        with _LOCK:
            _RUNNING.remove(name)


def tag(name: str | None = None) -> str:
    """``"[name] "`` while more than one fit runs, else ``""``; ``name`` defaults to the fit
    of the calling thread.

    >>> with running_fit("lr=0.1"), running_fit("lr=0.01"):
    ...     tag(), tag("lr=0.1")
    ('[lr=0.01] ', '[lr=0.1] ')
    >>> tag("lr=0.1")
    ''
    """
    name = _CURRENT.get() if name is None else name
    with _LOCK:
        several = len(_RUNNING) > 1
    return f"[{name}] " if name and several else ""


class _FitLogger(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        prefix = tag()
        return (f"{prefix}{msg}" if prefix else msg), kwargs


def fit_logger() -> logging.LoggerAdapter:
    """The fit's log (:data:`FIT_LOGGER`), whose records name the fit of the thread that
    logs them while several fits run (see :func:`tag`)."""
    return _FitLogger(logging.getLogger(FIT_LOGGER), {})
