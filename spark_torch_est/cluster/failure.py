"""[both] Failures: what went wrong on a rank, how it reaches the driver, and the one
policy that decides whether a failed job is relaunched.

A rank classifies its error **by cause** (:func:`describe`): a communication error or a
dead peer is a system failure in whatever stage it surfaced (a peer killed while the
survivor is in ``forward`` shows up there, as a gloo error of DDP's buffer broadcast); an
error in user code (creators, loss, hooks, shapes) is deterministic and not retried.

The rank then reports a :class:`Failure` twice: over the driver's authenticated channel
(which only the job's ranks reach) and sealed inside its exception text, which Spark,
Py4J or Spark Connect wrap and others may write into. So every report carries an HMAC
made with the job's secret; the driver drops reports that do not verify, and parses the
rest defensively (:meth:`Failure.unseal`). :func:`explain_job_failure` turns what is
left, or Spark's own error text, into the fit's error; what follows it (relaunch, reroute or
raise) is decided in :mod:`~spark_torch_est.cluster.control`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from spark_torch_est.core.running import fit_logger
from spark_torch_est.errors import (
    TRACEBACK,
    IncompatibleCheckpointError,
    InputDataError,
    InvalidInputError,
    SparkTorchError,
    TrainingFailedError,
    UserCodeError,
    frame_kind,
    frame_path,
)

__all__ = [
    "USER", "INPUT", "CHECKPOINT", "SYSTEM", "UNREACHABLE", "Failure", "RankFailure", "StoreUnreachableError",
    "PeerAuthenticationError", "SparkInputLost", "describe", "is_communication_error", "explain_job_failure",
    "is_spark_error", "package_bug",
]

logger = fit_logger()

USER = "user"                # user code raised (hook, creator, loss, model, shapes): deterministic, not retried
INPUT = "input"              # the rows cannot be trained on (nulls, ragged arrays, no rows): not retried
CHECKPOINT = "checkpoint"    # the checkpoint does not fit the model: not retried
SYSTEM = "system"            # a peer, the network, a collective or the process failed: retried
UNREACHABLE = "unreachable"  # the driver's rendezvous store could not be reached: rerouted
KINDS = (USER, INPUT, CHECKPOINT, SYSTEM, UNREACHABLE)

_BEGIN, _END = "<<spark_torch_est-failure ", " spark_torch_est-failure>>"
#: Text of errors raised by the transports and collectives (gloo, NCCL, the TCPStore):
#: the same communication failures surface as plain RuntimeErrors in any stage.
_COMMUNICATION = re.compile(
    r"gloo/transport|\[gloo\]|\bgloo\b.*(?:error|closed|timed? ?out)|NCCL|Connection (?:closed|reset|refused)"
    r"|Broken pipe|Timed out waiting|Socket Timeout|DistNetworkError|DistStoreError|connection to the store",
    re.IGNORECASE,
)
_MISUSE = re.compile(r"enforce fail|invalid usage|invalid argument|Duplicate GPU", re.IGNORECASE)
_MAX_MESSAGE = 4000
_MAX_TRACEBACK = 20000
_MAX_REPORT = 4 * (_MAX_MESSAGE + _MAX_TRACEBACK)  # JSON escapes included


class StoreUnreachableError(TrainingFailedError):
    """Executors could not reach the driver's rendezvous store (the launcher then
    rendezvouses through Spark's ``allGather`` instead)."""


class PeerAuthenticationError(RuntimeError):
    """A member of the process group could not prove it holds the job's secret."""


class SparkInputLost(ConnectionError):
    """The task's rows from Spark broke off: Spark cancelled the task (another rank failed,
    the job was cancelled) or a stage before it failed. A consequence, never the rows' fault."""


@dataclass(frozen=True)
class Failure:
    """What went wrong on one rank.

    Attributes:
        kind: One of USER, INPUT, CHECKPOINT, SYSTEM, UNREACHABLE.
        message: ``ExceptionType: message`` of the original exception.
        rank: The rank that failed.
        stage: The loop stage (``"setup"``, ``"after_train_iter"``, ...).
        hook: The hook that raised, if any.
        traceback: The formatted remote traceback.
    """

    kind: str
    message: str
    rank: int
    stage: str
    hook: str | None = None
    traceback: str = ""

    def seal(self, secret: bytes) -> str:
        """The failure as one line that survives Spark's error wrapping, with an HMAC
        of the job's secret (also what the channel carries)."""
        fields = dict(asdict(self), message=self.message[:_MAX_MESSAGE], traceback=self.traceback[-_MAX_TRACEBACK:])
        body = json.dumps(fields).replace(">", "\\u003e")  # so the end marker cannot occur inside
        return f"{_BEGIN}{_tag(secret, body)} {body}{_END}"

    @classmethod
    def unseal(cls, text: str | bytes, secret: bytes) -> Failure | None:
        """The first failure in ``text`` whose HMAC verifies and whose fields are well
        formed; None if there is none. Reports that fail either check are logged and
        ignored: whoever can write into a task's error text can write one. The scan is linear in the
        text: each begin marker is paired with the next end marker."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        position = 0
        while (begin := text.find(_BEGIN, position)) >= 0:
            end = text.find(_END, begin)
            if end < 0:
                break
            position = end + len(_END)
            tag, _, body = text[begin + len(_BEGIN):end].partition(" ")
            if len(body) > _MAX_REPORT or not hmac.compare_digest(tag.encode(), _tag(secret, body).encode()):
                logger.warning("ignored a failure report that does not carry this job's secret")
                continue
            try:
                return cls._parse(body)
            except ValueError as error:
                logger.warning("ignored a malformed failure report (%s)", error)
        return None

    @classmethod
    def _parse(cls, body: str) -> Failure:
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError("not an object")
        fields = {name: data.get(name) for name in ("kind", "message", "stage")}
        fields["traceback"] = data.get("traceback", "")
        text = {name: value for name, value in fields.items() if isinstance(value, str)}
        if fields["kind"] not in KINDS or len(text) < len(fields):
            raise ValueError("bad kind or text fields")
        rank, hook = data.get("rank"), data.get("hook")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError("bad rank")
        if not (hook is None or isinstance(hook, str)):
            raise ValueError("bad hook")
        return cls(kind=text["kind"], message=text["message"][:_MAX_MESSAGE], rank=rank, stage=text["stage"][:200],
                   hook=hook[:200] if hook else None, traceback=text["traceback"][-_MAX_TRACEBACK:])

    def to_error(self) -> SparkTorchError:
        """The driver-side exception for this failure."""
        where = f" on rank {self.rank} at {self.stage}"
        if self.kind == INPUT:
            return InputDataError(f"{self.message}{where}")
        if self.kind == CHECKPOINT:
            return IncompatibleCheckpointError(f"{self.message}{where}")
        origin = f"hook {self.hook!r} raised" if self.hook else "training failed"
        error_type = StoreUnreachableError if self.kind == UNREACHABLE else TrainingFailedError
        return error_type(
            f"{origin}: {self.message}", rank=self.rank, stage=self.stage, hook=self.hook,
            remote_traceback=self.traceback or None, retryable=self.kind == SYSTEM,
        )


def _tag(secret: bytes, body: str) -> str:
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()


class RankFailure(RuntimeError):
    """Raised by a training task so that Spark fails the barrier job with a sealed report."""

    def __init__(self, failure: Failure, secret: bytes) -> None:
        super().__init__(f"rank {failure.rank} failed at {failure.stage}: {failure.message}\n{failure.seal(secret)}")
        self.failure = failure


# ------------------------------------------------------------------------- on a rank


def is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` comes from the network, a peer or a collective rather than from
    the code or data being trained (which would fail the same way again)."""
    import torch.distributed as dist

    if isinstance(error, (dist.DistError, PeerAuthenticationError, ConnectionError, TimeoutError)):
        return True
    text = str(error)
    if _MISUSE.search(text):  # collectives called wrongly by user code fail the same way again
        return False
    return isinstance(error, RuntimeError) and bool(_COMMUNICATION.search(text))


def describe(error: BaseException, rank: int, stage: str, hook: str | None) -> Failure:
    """Classifies a rank's error by its cause and records where it happened."""
    if isinstance(error, InvalidInputError):  # the data or a Param the schema could not check on the driver
        kind = INPUT
    elif isinstance(error, IncompatibleCheckpointError):
        kind = CHECKPOINT
    elif isinstance(error, StoreUnreachableError):
        kind = UNREACHABLE
    elif isinstance(error, UserCodeError):  # checked where the user's code handed back its value: never ours
        kind = USER
    elif is_communication_error(error) or isinstance(error, KeyboardInterrupt):  # KeyboardInterrupt: task killed
        kind = SYSTEM
    elif stage == "rendezvous":  # no user code runs there: a peer or an address read from the store failed
        kind = SYSTEM
    elif isinstance(error, OSError) and stage == "ingest":  # reading a table's files: storage hiccups pass
        kind = SYSTEM
    else:
        kind = USER
    message = "; ".join([f"{type(error).__name__}: {error}", *getattr(error, "__notes__", ())])
    if isinstance(error, ModuleNotFoundError) and stage == "setup":
        message += (f"; a creator or hook refers to module {error.name!r}, which the executors cannot import: "
                    "ship it (--py-files), define it in __main__ or a notebook, or call "
                    f"cloudpickle.register_pickle_by_value on it")
    elif isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        message += "; lower batchSize, memoryBudgetMB or the model's size, or give the tasks more memory"
    elif (where := _raised_in_package(error)) is not None:
        message += f"; {_BUG} (raised at {where})"
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return Failure(kind=kind, message=message, rank=rank, stage=stage, hook=hook, traceback=text)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # spark_torch_est/
_BUG = ("a bug in spark_torch_est, or a release of torch, pyspark or pyarrow it does not support "
        "(docs/cluster.md, support matrix): please report it with this traceback")


def _raised_in_package(error: BaseException) -> str | None:
    """``file:line`` of the package's own code where an AttributeError, TypeError or
    NameError was raised (its innermost frame is this package's), else None."""
    if not isinstance(error, (AttributeError, TypeError, NameError)) or error.__traceback__ is None:
        return None
    frame = traceback.extract_tb(error.__traceback__)[-1]
    if not os.path.abspath(frame.filename).startswith(_PACKAGE + os.sep):
        return None
    return f"{os.path.relpath(frame.filename, os.path.dirname(_PACKAGE))}:{frame.lineno}"


# ---------------------------------------------------------------------- on the driver


def is_spark_error(error: BaseException) -> bool:
    """Whether ``error`` is Spark's (a failed job, a lost connection to Spark's JVM or
    Connect server), whose text :func:`explain_job_failure` reads; anything else raised
    while a job runs on the driver, and pyspark's ``PySparkAttributeError`` and
    ``PySparkTypeError`` (an API called wrongly), is this package's own bug (:func:`package_bug`)."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    misuse = isinstance(error, (AttributeError, TypeError, NameError))
    return isinstance(error, (PySparkException, Py4JError)) and not misuse


def package_bug(error: BaseException) -> TrainingFailedError:
    """The fit's error for a bug of this package met on the driver: never retried."""
    where = _raised_in_package(error)
    return TrainingFailedError(f"the driver failed while the training job ran: {type(error).__name__}: {error}; "
                               f"{_BUG}" + (f" (raised at {where})" if where else ""))

_RESULT_TOO_LARGE = re.compile(r"bigger than spark\.driver\.maxResultSize \(([^)\n]{0,100})\)")
_MISSING_MODULE = re.compile(r"No module named '?([\w.]+)'?")  # python -m names the module unquoted
#: The executors' PySpark daemon did not start (``spark.python.daemon.module``).
_DAEMON_FAILED = re.compile(r"reading the port number from ([\w.]+)'s stdout")
#: Spark could not read the input's files (a corrupt file, a column type it cannot convert): a relaunch
#: reads them again. Matched in the line around a marker (see :func:`_lines_around`).
_READ_MARKERS = ("[FAILED_READ_FILE", "[CANNOT_READ_FILE_FOOTER")
_READ_FAILED = re.compile(r"\[(?:FAILED_READ_FILE|CANNOT_READ_FILE_FOOTER)[.\w]{0,100}\].*?(?=\s{1,8}SQLSTATE|$)")
_READ_CAUSE = re.compile(r"^Caused by: (?!org\.apache\.spark\.SparkException)([^\n]+)", re.MULTILINE)
_BARRIER_UNSUPPORTED = re.compile(r"Barrier execution mode does not (?:allow|support).*?(?=\n\s+at |\Z)", re.DOTALL)
#: Where PySpark says a task's Python raised, shortly before the traceback it gives: a
#: PythonException, or the captured one's "thrown from the Python worker" (Spark 3.5 and 4).
_PYTHON_RAISED = ("PythonException", "thrown from the Python worker")
_CHAINED = ("During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")
#: Spark's data errors: SQLSTATE class 22 (data exception: a cast or arithmetic under ANSI
#: mode), which Spark 3.5 leaves out of the text, naming them by the exception's class instead.
_DATA_STATE = "SQLSTATE: 22"
_DATA_EXCEPTIONS = tuple(f"org.apache.spark.Spark{name}Exception: ["
                         for name in ("NumberFormat", "Arithmetic", "DateTime", "ArrayIndexOutOfBounds"))
_ERROR_CLASS = re.compile(r"\[[A-Z][A-Z_.]{0,100}\]")
#: A failed job's text may be megabytes, and partly anyone's (a task's exception message): the
#: markers are found with ``str.find``, at most this many occurrences of each, and patterns
#: only ever run on a line around one, of at most ``_WINDOW`` characters either side.
_HITS = 16
_WINDOW = 2000
_MAX_LINES = 400  # lines of a traceback read at most


def explain_job_failure(text: str, reported: list[Failure], secret: bytes) -> SparkTorchError:
    """Maps a failed job to the most specific error: a file Spark could not read, else a
    rank's own report (a user error before the "connection closed" its peers saw), else
    what Spark's error text shows.

    Args:
        text: The exception text of the failed job.
        reported: Verified failures the ranks reported over the driver's channel.
        secret: The job's secret, to verify a report inside ``text``.
    """
    unreadable = next((matched for marker in _READ_MARKERS for line, at in _lines_around(text, marker)
                       if (matched := _READ_FAILED.match(line, at))), None)
    if unreadable:  # the cause, whatever a rank reported of it (its rows' stream broke off)
        cause = _READ_CAUSE.search(text)
        return InputDataError(f"Spark cannot read the training table: {unreadable.group(0).strip()}"
                              + (f" ({cause.group(1).strip()[:500]})" if cause else "")
                              + "; fix or remove that file (a relaunch would read it again)")
    found = Failure.unseal(text, secret)
    candidates = reported + ([found] if found is not None else [])
    own = dataframe_error(text)
    if own is not None and all(f.kind in (SYSTEM, UNREACHABLE) for f in candidates):  # the ranks' lost input follows
        return own
    if candidates:  # a rank's own error first, then a peer that failed to prove the secret (an impostor)
        return min(candidates, key=lambda f: (f.kind == SYSTEM, not f.message.startswith("PeerAuthenticationError"))
                   ).to_error()
    too_large = _RESULT_TOO_LARGE.search(text)
    if too_large:
        return TrainingFailedError(
            f"the checkpoint is bigger than spark.driver.maxResultSize ({too_large.group(1)}); raise it, "
            "e.g. --conf spark.driver.maxResultSize=4g"
        )
    missing = _MISSING_MODULE.search(text)
    if missing:
        daemon = _DAEMON_FAILED.search(text)
        fix = (f"it is the Python workers' daemon, spark.python.daemon.module={daemon.group(1)}: install "
               "spark_torch_est in the executors' Python (the daemon starts before any file a job ships) or "
               "leave the setting out" if daemon else
               "point PYSPARK_PYTHON at an environment with torch and spark_torch_est, or ship the package "
               "(--py-files / --archives)")
        return TrainingFailedError(f"the executors' Python cannot import {missing.group(1)!r}: {fix}",
                                   remote_traceback=text[-4000:])
    unsupported = _BARRIER_UNSUPPORTED.search(text)
    if unsupported:  # e.g. dynamic allocation, or more slots than the cluster has
        return InvalidInputError(f"Spark cannot run the barrier job: {unsupported.group(0).strip()}")
    return TrainingFailedError(f"the training job failed: {_first_line(text)}",
                               remote_traceback=text[-4000:], retryable=True)


def dataframe_error(text: str) -> TrainingFailedError | None:
    """The training DataFrame's own error, when that is what failed the job of ``text``: a
    Python exception its plan raised, whose traceback shows the user's code (a user-defined
    function, a notebook cell) and none of this package's, or enters this package through
    a ``TorchModel``'s transform (a model's predictions in the DataFrame), or one of Spark's
    data errors (SQLSTATE class 22). Computing the rows again meets it again, so it is never
    retried; None for anything else (a cut-off traceback, PySpark's own error, a crash)."""
    raised = _python_error(text)
    if raised is not None:
        paths, exception, traceback_text = raised
        kinds = {frame_kind(path) for path in paths}
        ours = [path for path in paths if frame_kind(path) == "package"]
        transform = bool(ours) and _package_folder(ours[0]) == _TRANSFORM_FOLDER
        if transform or ("user" in kinds and "package" not in kinds):
            return TrainingFailedError(
                "the training DataFrame's own code failed while Spark computed its rows"
                + (" (a TorchModel's transform in it)" if transform else "")
                + f", before any rank trained on them: {exception[:500]}; fix the DataFrame (a relaunch would compute "
                "its rows again)", remote_traceback=traceback_text[-4000:])
    for marker in (_DATA_STATE, *_DATA_EXCEPTIONS):
        for line, at in _lines_around(text, marker):
            if marker == _DATA_STATE:  # the error class before it on its line: "[CAST_INVALID_INPUT] The value ..."
                named = _ERROR_CLASS.search(line, 0, at)
                message = line[named.start():at] if named else None
            else:  # "org.apache.spark.SparkNumberFormatException: [CAST_INVALID_INPUT] The value ..."
                message = line[at + len(marker) - 1:]
            if message:
                return TrainingFailedError(
                    f"Spark failed to compute the training DataFrame's rows: {message.strip()[:500]}; fix the "
                    "DataFrame or its data (a relaunch would compute its rows again)")
    return None


#: Where a traceback enters this package when a ``TorchModel``'s transform runs in a DataFrame's plan.
_TRANSFORM_FOLDER = "scoring"


def _package_folder(path: str) -> str:
    """The folder of this package a frame's ``path`` is in (``"scoring"``), ``""`` for its top level."""
    parts = re.split(r"[/\\]", path)
    package = len(parts) - 1 - parts[::-1].index("spark_torch_est")  # the last such folder: a zip's holds it too
    below = parts[package + 1:]  # its folders, then the file
    return below[0] if len(below) > 1 else ""


def _python_error(text: str) -> tuple[list[str], str, str] | None:
    """The first Python traceback PySpark reports in ``text``: its frames' paths, its
    exception line (the last one, of exceptions chained to it) and its text; None when
    there is none, or it is cut off before its exception."""
    for at in _occurrences(text, TRACEBACK):
        if not any(marker in text[max(0, at - 300):at] for marker in _PYTHON_RAISED):
            continue
        paths: list[str] = []
        raised: str | None = None
        lines: list[str] = []
        in_block = chained = False
        for line in _lines_from(text, at):
            if line.startswith(TRACEBACK):
                if raised is not None and not chained:
                    break  # another traceback, not chained to this one
                in_block, chained = True, False
            elif in_block and (path := frame_path(line)) is not None:
                paths.append(path)
            elif in_block and line.startswith("  "):
                pass  # the frame's code, or its ^ markers
            elif in_block:
                raised, in_block = line.strip(), False
            elif line.strip() in _CHAINED:
                chained = True
            lines.append(line)
        return (paths, raised, "\n".join(lines)) if raised else None
    return None


def _occurrences(text: str, marker: str) -> Iterator[int]:
    """Where the first :data:`_HITS` occurrences of ``marker`` start in ``text``."""
    position = 0
    for _ in range(_HITS):
        found = text.find(marker, position)
        if found < 0:
            return
        yield found
        position = found + len(marker)


def _lines_around(text: str, marker: str) -> Iterator[tuple[str, int]]:
    """The line around each of :func:`_occurrences` of ``marker`` (at most :data:`_WINDOW`
    characters on either side of it), and where the marker starts in it."""
    for found in _occurrences(text, marker):
        low = max(0, found - _WINDOW)
        start = text.rfind("\n", low, found) + 1 or low
        end = text.find("\n", found, found + _WINDOW)
        line = text[start:end if end >= 0 else found + _WINDOW]
        yield line, found - start


def _lines_from(text: str, at: int) -> Iterator[str]:
    """The lines of ``text`` from ``at`` on, at most :data:`_MAX_LINES`, each cut to
    :data:`_WINDOW` characters."""
    position = at
    for _ in range(_MAX_LINES):
        if position >= len(text):
            return
        end = text.find("\n", position)
        end = len(text) if end < 0 else end
        yield text[position:min(end, position + _WINDOW)]
        position = end + 1


def _first_line(text: str) -> str:
    """The most telling line of a Spark error: the first exception that is not the
    generic "Job aborted" wrapper."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    specific = [line for line in errors if "Job aborted" not in line]
    return (specific or errors or lines or ["(no message)"])[0][:500]
