"""[both] The driver's view of a running fit: a small authenticated message channel.

The driver listens on its own host with the job's secret; ranks connect with
``multiprocessing.connection``'s HMAC challenge (a connection without the secret is
refused before any message is read) and send :class:`~spark_torch_est.cluster.messages.RankMessage`
as JSON: rank 0 its progress and epoch metrics, every rank its warning and error log
lines. The server decodes each one as it arrives and drops, with a DEBUG line, one it
cannot read. Losing the channel never stops training: the result and history still come
back with the checkpoint.

Rank 0 also sends the checkpoint here (:meth:`ChannelClient.send_blob`): a header, the
bytes in parts, and the driver's acknowledgement once their SHA-256 matches. Only an
acknowledged checkpoint counts as delivered; without one the rank returns it as result
rows of the Spark job instead, which is much slower (docs/benchmarks.md) and bounded by
``spark.driver.maxResultSize``.

When a driver-side logger may stop the fit, rank 0 asks at each epoch end
(:meth:`ChannelClient.ask_stop`) and the driver answers on the same connection, within
the loggers' deadlines; the ranks combine the answer at the epoch end's flag agreement.

A rank that fails sends its failure report here too (:meth:`ChannelClient.report`) and
fails its task once the driver acknowledged it, so the driver holds the root cause when
Spark tells it the job failed; only the job's ranks can read or write these reports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from spark_torch_est.cluster.authenticated import AuthenticatingServer, limit_waits
from spark_torch_est.cluster.failure import Failure
from spark_torch_est.cluster.messages import RankMessage
from spark_torch_est.core.progress import Progress

__all__ = ["ChannelServer", "ChannelClient", "LogForwarder", "ProgressReporter", "EXECUTOR_ONLY"]

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 1 << 20
_PART_BYTES = 16 << 20
_MAX_REPORTS = 4096
#: Seconds rank 0 waits for the driver's stop answer beyond the driver's own wait.
_ANSWER_MARGIN_S = 10.0


class ChannelServer(AuthenticatingServer):
    """Accepts authenticated rank connections and hands each message to ``on_message``;
    holds the job's checkpoint blob and the ranks' failure reports for the launcher.

    Args:
        host: The address to bind (the driver host; never all interfaces).
        secret: The job's key the ranks must prove they hold.
        on_message: Called from reader threads with each message, decoded.
        on_ask: ``on_ask(epoch)``: whether the fit should stop at the end of ``epoch``, rank
            0's question; called from its reader thread, it must return within the rank's
            wait (default: never stop).
        handshake_timeout: Seconds a new connection has to authenticate (default 5).
        max_blob_bytes: Most bytes of blobs held at once (default None: any size). A blob
            beyond ``max_blobs``, or one announced larger than what is left of this, closes the
            sender's connection before any of its bytes is read.
        max_blobs: Blobs accepted (default 1: a job has one checkpoint to send; a job that
            trains several runs in turn sends one per run and then its result).

    Attributes:
        address: ``(host, port)`` to give the ranks.
        rejected: How many connections failed or did not finish authentication.
    """

    def __init__(self, host: str, secret: bytes, on_message: Callable[[RankMessage], None],
                 handshake_timeout: float = 5.0, max_blob_bytes: int | None = None,
                 on_ask: Callable[[int], bool] | None = None, max_blobs: int = 1) -> None:
        self.max_blob_bytes = max_blob_bytes
        self._blobs_left = max_blobs
        self.on_message = on_message
        self.on_ask = on_ask or (lambda epoch: False)
        self._blobs: dict[tuple[str, str], bytes] = {}  # (key, SHA-256 hex) -> bytes
        self._failures: dict[int, Failure] = {}  # by rank
        super().__init__(host, secret, handshake_timeout)

    def _serve_authenticated(self, connection: Connection) -> None:
        self._read(connection)

    def _read(self, connection: Connection) -> None:
        while True:
            try:
                message = json.loads(connection.recv_bytes(_MAX_MESSAGE))
                if isinstance(message, dict) and message.get("type") == "blob":
                    if not self._admit_blob(message):
                        self._drop(connection)
                        return
                    self._receive_blob(connection, message)
                    continue
                if isinstance(message, dict) and message.get("type") == "failure":
                    self._keep_failure(connection, message)
                    continue
                if isinstance(message, dict) and message.get("type") == "stop?":
                    self._answer_stop(connection, message)
                    continue
            except (EOFError, OSError, ValueError, TypeError, KeyError):  # TypeError: closed by close()
                return
            except RecursionError:  # JSON nested past Python's stack: not a message of ours
                logger.warning("the driver's channel dropped a connection that sent JSON nested too deep")
                self._drop(connection)
                return
            try:
                decoded = RankMessage.from_dict(message)
            except ValueError as error:  # never a reason to stop reading the rank's messages
                logger.debug("the driver's channel dropped a message: %s", error)
                continue
            try:
                self.on_message(decoded)
            except Exception:  # a display problem must not stop the stream
                logger.exception("progress message handler failed")

    def _keep_failure(self, connection: Connection, message: dict) -> None:
        """Keeps a rank's failure report (the first per rank, at most ``_MAX_REPORTS``),
        then acknowledges it: the rank fails its task only after the driver holds it."""
        failure = Failure.unseal(str(message.get("report", "")), self.secret)
        with self._lock:
            if failure is not None and len(self._failures) < _MAX_REPORTS:
                self._failures.setdefault(failure.rank, failure)
        connection.send_bytes(json.dumps({"type": "ack", "key": "failure"}).encode())

    def _answer_stop(self, connection: Connection, message: dict) -> None:
        """Answers rank 0's question whether the fit stops at the end of its epoch."""
        epoch = message["epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise ValueError(f"not an epoch: {epoch!r}")
        try:
            stop = bool(self.on_ask(epoch))
        except Exception:  # the fit goes on
            logger.exception("answering whether the fit stops failed")
            stop = False
        connection.send_bytes(json.dumps({"type": "stop", "epoch": epoch, "stop": stop}).encode())

    def failures(self) -> list[Failure]:
        """The failures the ranks reported, in rank order."""
        with self._lock:
            return [self._failures[rank] for rank in sorted(self._failures)]

    def _admit_blob(self, header: dict) -> bool:
        """Whether to read the blob ``header`` announces: one of the job's ``max_blobs`` first,
        within the size limit."""
        size = int(header["size"])
        with self._lock:
            held = sum(len(blob) for blob in self._blobs.values())  # not taken yet
            refused = self._blobs_left <= 0 or size < 0 or (self.max_blob_bytes is not None and
                                                             size + held > self.max_blob_bytes)
            self._blobs_left -= 1
        if refused:
            logger.warning("the driver's channel refused a blob of %d bytes (beyond the job's blobs, or over %s bytes)",
                           size, self.max_blob_bytes)
        return not refused

    def _receive_blob(self, connection: Connection, header: dict) -> None:
        """Reads the parts announced by ``header``; keeps and acknowledges them only when
        their size and SHA-256 match."""
        size, parts, digest = int(header["size"]), [], hashlib.sha256()
        received = 0
        while received < size:
            part = connection.recv_bytes(_PART_BYTES)
            digest.update(part)
            parts.append(part)
            received += len(part)
        if received != size or digest.hexdigest() != header["sha256"]:
            logger.warning("a checkpoint sent over the channel arrived damaged; the rank falls back to result rows")
            connection.send_bytes(json.dumps({"type": "nack", "key": header["key"]}).encode())
            return
        with self._lock:
            self._blobs[(header["key"], header["sha256"])] = b"".join(parts)
        del parts
        connection.send_bytes(json.dumps({"type": "ack", "key": header["key"]}).encode())

    def take_blob(self, key: str, sha256: str) -> bytes | None:
        """Removes and returns the acknowledged blob sent under ``key``, if it is the one
        whose SHA-256 (hex) is ``sha256``."""
        with self._lock:
            return self._blobs.pop((key, sha256), None)

    def close(self) -> None:
        super().close()
        with self._lock:
            self._blobs.clear()


def _plain(value: Any) -> Any:
    """JSON for numbers hooks put in metrics: tensors and numpy scalars become floats."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


class ChannelClient:
    """A rank's end of the channel; ``send`` never raises (the channel is best effort).

    Args:
        address: The server's ``(host, port)``.
        secret: The fit's key.
        connect_timeout: Seconds to wait for the driver to answer.

    Raises:
        OSError, AuthenticationError: The driver is unreachable or refused the key.
    """

    def __init__(self, address: tuple[str, int], secret: bytes, connect_timeout: float = 5.0) -> None:
        host, port = address
        sock = socket.create_connection((host, port), timeout=connect_timeout)
        limit_waits(sock, connect_timeout)
        connection = Connection(sock.detach())
        answer_challenge(connection, secret)
        deliver_challenge(connection, secret)
        self._connection: Connection | None = connection
        self._secret = secret
        self._lock = threading.Lock()

    def send(self, message: RankMessage) -> None:
        """Sends one message as JSON; drops the channel on the first error."""
        if self._connection is None:
            return
        try:
            with self._lock:
                self._connection.send_bytes(json.dumps(message.to_dict(), default=_plain).encode())
        except (OSError, ValueError, TypeError):
            self.close()

    def report(self, failure: Failure, timeout: float = 10.0) -> bool:
        """Sends a rank's failure report and waits (at most ``timeout`` seconds) until the
        driver holds it; whether it does."""
        if self._connection is None:
            return False
        try:
            with self._lock:
                self._connection.send_bytes(json.dumps({"type": "failure",
                                                        "report": failure.seal(self._secret)}).encode())
                if not self._connection.poll(timeout):
                    return False
                reply = json.loads(self._connection.recv_bytes(_MAX_MESSAGE))
        except (OSError, EOFError, ValueError, TypeError):
            self.close()
            return False
        return reply == {"type": "ack", "key": "failure"}

    def ask_stop(self, epoch: int, timeout: float) -> bool:
        """Asks the driver whether the fit stops at the end of ``epoch``; waits at most
        ``timeout`` seconds. No answer in time (or a broken channel) goes on: False, and the
        channel is closed, so a late answer is never read as another reply."""
        if self._connection is None:
            return False
        try:
            with self._lock:
                self._connection.send_bytes(json.dumps({"type": "stop?", "epoch": epoch}).encode())
                if not self._connection.poll(timeout):
                    raise TimeoutError(f"no answer within {timeout:.0f}s")
                reply = json.loads(self._connection.recv_bytes(_MAX_MESSAGE))
            if isinstance(reply, dict) and reply.get("type") == "stop" and reply.get("epoch") == epoch:
                return reply.get("stop") is True
            problem = f"an unexpected reply ({reply})"
        except (OSError, EOFError, ValueError, TypeError, TimeoutError) as error:
            problem = str(error) or type(error).__name__
        self.close()
        logger.warning("the driver did not say whether to stop after epoch %d (%s): the fit goes on without the "
                       "driver's channel", epoch, problem)
        return False

    def send_blob(self, key: str, blob: bytes | memoryview, ack_timeout: float | None = None) -> str | None:
        """Sends ``blob`` and waits for the driver's acknowledgement.

        Args:
            key: What the driver files it under (the job id).
            blob: The bytes.
            ack_timeout: Seconds to wait for the acknowledgement; by default 30 s plus
                one second per 50 MB.

        Returns:
            The bytes' SHA-256 (hex) once the driver holds them, verified; None otherwise
            (the channel is then closed and the caller sends the bytes another way).
        """
        if self._connection is None:
            return None
        view = memoryview(blob).cast("B")
        digest = hashlib.sha256(view).hexdigest()
        header = {"type": "blob", "key": key, "size": len(view), "sha256": digest}
        timeout = ack_timeout if ack_timeout is not None else 30.0 + len(view) / 50e6
        try:
            with self._lock:
                self._connection.send_bytes(json.dumps(header).encode())
                for start in range(0, len(view), _PART_BYTES):
                    self._connection.send_bytes(view[start:start + _PART_BYTES])
                if not self._connection.poll(timeout):
                    raise TimeoutError(f"no acknowledgement within {timeout:.0f}s")
                reply = json.loads(self._connection.recv_bytes(_MAX_MESSAGE))
            if reply.get("type") == "ack" and reply.get("key") == key:
                return digest
            problem = f"the driver refused it ({reply})"
        except (OSError, EOFError, ValueError, TypeError, TimeoutError) as error:
            problem = str(error) or type(error).__name__
        self.close()  # first: a log handler that forwards to this channel must not write into it
        logger.warning("could not send the checkpoint over the channel (%s); returning it as result rows", problem)
        return None

    def close(self) -> None:
        """Closes the connection."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None


#: A log record with this attribute set (``extra={EXECUTOR_ONLY: True}``) stays in the executor's log.
EXECUTOR_ONLY = "spark_torch_est_executor_only"


class LogForwarder(logging.Handler):
    """Sends a rank's warning and error log records to the driver."""

    def __init__(self, client: ChannelClient, rank: int) -> None:
        super().__init__(logging.WARNING)
        self.client = client
        self.rank = rank

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, EXECUTOR_ONLY, False):
            return
        self.client.send(RankMessage.for_log(self.rank, record.levelno, record.name, record.getMessage()))


class ProgressReporter:
    """Rank 0's throttled progress messages; a no-op on other ranks or without a channel.

    Args:
        client: The channel, or None.
        rank: This rank.
        interval: Minimum seconds between progress messages.
    """

    def __init__(self, client: ChannelClient | None, rank: int, interval: float = 0.5) -> None:
        self.client = client if rank == 0 else None
        self.interval = interval
        self._last = 0.0
        self._last_position: float | None = None

    def step(self, progress: Progress, loss: float, steps_per_epoch: int) -> None:
        """Reports the position after a step and its loss (read by the loop, a number), at
        most every ``interval`` seconds."""
        if self.client is None:
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = self._last_position = now
        self.client.send(RankMessage.for_step(progress, loss, steps_per_epoch))

    def position(self, progress: Progress, steps_per_epoch: int) -> None:
        """Reports the position after a step whose loss is not read yet: the first at once,
        then at most every ``interval`` seconds (a step report counts)."""
        if self.client is None:
            return
        now = time.monotonic()
        if self._last_position is not None and now - self._last_position < self.interval:
            return
        self._last_position = now
        self.client.send(RankMessage.for_position(progress, steps_per_epoch))

    def run_done(self, run: int, progress: Progress, delivered: str) -> None:
        """Reports that the job's run ``run`` ended at ``progress``, its checkpoint delivered
        (SHA-256) or not (``""``); the next run begins, and its first position goes at once."""
        self._last, self._last_position = 0.0, None
        if self.client is not None:
            self.client.send(RankMessage.for_run_done(run, progress, delivered))

    def epoch(self, entry: dict) -> None:
        """Reports a finished epoch's history entry."""
        if self.client is not None:
            self.client.send(RankMessage.for_epoch(entry))

    def stop_asked(self, epoch: int, wait: float) -> bool:
        """Rank 0: whether the driver's loggers ask the fit to stop at the end of ``epoch``
        (reported with :meth:`epoch` before), waiting at most ``wait`` seconds plus a margin
        for the network; False on other ranks and without a channel."""
        return self.client is not None and self.client.ask_stop(epoch, wait + _ANSWER_MARGIN_S)

    def note(self, logger_name: str, message: str, level: int = logging.INFO) -> None:
        """Logs ``message`` at ``level`` on the driver, once (rank 0's log forwarder sends warnings only)."""
        if self.client is not None:
            self.client.send(RankMessage.for_log(0, level, logger_name, message))
