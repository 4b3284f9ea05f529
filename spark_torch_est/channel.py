"""[both] The driver's view of a running fit: a small authenticated message channel.

The driver listens on its own host with the job's secret; ranks connect with
``multiprocessing.connection``'s HMAC challenge (a connection without the secret is
refused before any message is read) and send JSON messages: rank 0 its progress and
epoch metrics, every rank its warning and error log lines. Losing the channel never
stops training: the result and history still come back with the checkpoint.

Rank 0 also sends the checkpoint here (:meth:`ChannelClient.send_blob`): a header, the
bytes in parts, and the driver's acknowledgement once their SHA-256 matches. Only an
acknowledged checkpoint counts as delivered; without one the rank returns it as result
rows of the Spark job instead, which is slower (about 40 MB/s against hundreds) and
bounded by ``spark.driver.maxResultSize``.

A rank that fails sends its failure report here too (:meth:`ChannelClient.report`) and
fails its task once the driver acknowledged it, so the driver holds the root cause when
Spark tells it the job failed; only the job's ranks can read or write these reports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from typing import Any, Callable

from spark_torch_est.failure import Failure

__all__ = ["AuthenticatingServer", "ChannelServer", "ChannelClient", "LogForwarder", "ProgressReporter",
           "EXECUTOR_ONLY", "limit_waits"]

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 1 << 20
_PART_BYTES = 16 << 20
_MAX_PENDING = 32
_MAX_REPORTS = 4096


class AuthenticatingServer:
    """Accepts connections on ``host`` and hands each one that proves it holds ``secret``
    (``multiprocessing.connection``'s HMAC challenge, both ways) to
    :meth:`_serve_authenticated`, in its own thread.

    Every connection gets its own thread, whose HMAC handshake must finish within
    ``handshake_timeout`` seconds: a connection that never speaks only holds its own
    thread for that long, never the accept loop, and at most ``_MAX_PENDING`` handshakes
    run at once (a newcomer past that drops the oldest). Before it authenticates, nothing
    a connection sends is read but the handshake's own messages (at most 256 bytes).

    Args:
        host: The address to bind (the driver host; never all interfaces).
        secret: The job's key the clients must prove they hold.
        handshake_timeout: Seconds a new connection has to authenticate (default 5).

    Attributes:
        address: ``(host, port)`` to give the ranks.
        rejected: How many connections failed or did not finish authentication.
    """

    #: What log lines call this server.
    what = "the driver's channel"

    def __init__(self, host: str, secret: bytes, handshake_timeout: float = 5.0) -> None:
        self.secret = secret
        self.handshake_timeout = handshake_timeout
        self.rejected = 0
        self._closed = threading.Event()
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind((host, 0))
        self._socket.listen(64)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        self._connections: list[Connection] = []
        self._pending: dict[socket.socket, float] = {}  # authenticating connections, by when they came
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="spark_torch_est-channel", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._socket.accept()
            except OSError:
                continue
            if self._closed.is_set():
                sock.close()
                break
            with self._lock:
                if len(self._pending) >= _MAX_PENDING:  # the oldest gives way: a rank's handshake takes
                    oldest = min(self._pending, key=self._pending.get)  # milliseconds, a stalling one seconds
                    self._refuse(oldest, "too many connections were authenticating at once; dropped the oldest")
                # One deadline for the whole handshake, however slowly the peer drips bytes:
                deadline = threading.Timer(self.handshake_timeout, self._expire, args=(sock,))
                self._pending[sock] = time.monotonic()
            deadline.daemon = True
            deadline.start()
            threading.Thread(target=self._serve, args=(sock, deadline), name="spark_torch_est-channel-reader",
                             daemon=True).start()

    def _expire(self, sock: socket.socket) -> None:
        with self._lock:
            if sock in self._pending:
                self._refuse(sock, f"it did not authenticate within {self.handshake_timeout:.0f}s")

    def _refuse(self, sock: socket.socket, why: str) -> None:
        """Ends a connection that did not authenticate; its reader's waits return at once.
        Callers hold the lock."""
        self._pending.pop(sock, None)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already gone
            pass
        sock.close()
        self.rejected += 1
        logger.debug("refused a connection to %s: %s", self.what, why)
        if self.rejected in (1, 100, 10_000):  # a flood would otherwise flood the log too
            logger.warning("refused %d connection(s) to %s: %s", self.rejected, self.what, why)

    def _serve(self, sock: socket.socket, deadline: threading.Timer) -> None:
        """Authenticates one connection before its deadline, then serves it."""
        connection = None
        try:
            limit_waits(sock, self.handshake_timeout)
            connection = Connection(os.dup(sock.fileno()))  # shutting sock down (_refuse) ends its reads
            deliver_challenge(connection, self.secret)
            answer_challenge(connection, self.secret)
            limit_waits(sock, 0)  # authenticated: from now on wait as long as the fit runs
        except (AuthenticationError, OSError, EOFError, ValueError) as error:
            with self._lock:
                if sock in self._pending:
                    self._refuse(sock, f"it did not prove it holds the job's secret ({type(error).__name__})")
            if connection is not None:
                connection.close()
            return
        finally:
            deadline.cancel()
        with self._lock:
            if self._pending.pop(sock, None) is None or self._closed.is_set():  # dropped meanwhile
                connection.close()
                sock.close()
                return
            self._connections.append(connection)
        sock.close()  # the connection holds its own descriptor of the same socket
        self._serve_authenticated(connection)

    def _serve_authenticated(self, connection: Connection) -> None:
        """Serves one authenticated connection until it ends (in its own thread)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stops accepting, closes every connection and joins the accept thread."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:  # wake the blocking accept()
            socket.create_connection(self.address, timeout=1).close()
        except OSError:
            pass
        self._thread.join(5)
        self._socket.close()
        with self._lock:
            for connection in self._connections:
                connection.close()


class ChannelServer(AuthenticatingServer):
    """Accepts authenticated rank connections and hands each message to ``on_message``;
    holds the job's checkpoint blob and the ranks' failure reports for the launcher.

    Args:
        host: The address to bind (the driver host; never all interfaces).
        secret: The job's key the ranks must prove they hold.
        on_message: Called from reader threads with each decoded message.
        handshake_timeout: Seconds a new connection has to authenticate (default 5).
        max_blob_bytes: Largest blob accepted (default None: any size). One blob per server
            (a job has one checkpoint to send): a second one, or one announced larger, closes
            the sender's connection before any of its bytes is read.

    Attributes:
        address: ``(host, port)`` to give the ranks.
        rejected: How many connections failed or did not finish authentication.
    """

    def __init__(self, host: str, secret: bytes, on_message: Callable[[dict], None],
                 handshake_timeout: float = 5.0, max_blob_bytes: int | None = None) -> None:
        self.max_blob_bytes = max_blob_bytes
        self._blob_started = False
        self.on_message = on_message
        self._blobs: dict[tuple[str, str], bytes] = {}  # (key, SHA-256 hex) -> bytes
        self._failures: dict[int, Failure] = {}  # by rank
        super().__init__(host, secret, handshake_timeout)

    def _serve_authenticated(self, connection: Connection) -> None:
        self._read(connection)

    def _read(self, connection: Connection) -> None:
        while True:
            try:
                message = json.loads(connection.recv_bytes(_MAX_MESSAGE))
                if not isinstance(message, dict):
                    continue
                if message.get("type") == "blob":
                    if not self._admit_blob(message):
                        connection.close()
                        return
                    self._receive_blob(connection, message)
                    continue
                if message.get("type") == "failure":
                    self._keep_failure(connection, message)
                    continue
            except (EOFError, OSError, ValueError, TypeError, KeyError):  # TypeError: closed by close()
                return
            except RecursionError:  # JSON nested past Python's stack: not a message of ours
                logger.warning("the driver's channel dropped a connection that sent JSON nested too deep")
                connection.close()
                return
            try:
                self.on_message(message)
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

    def failures(self) -> list[Failure]:
        """The failures the ranks reported, in rank order."""
        with self._lock:
            return [self._failures[rank] for rank in sorted(self._failures)]

    def _admit_blob(self, header: dict) -> bool:
        """Whether to read the blob ``header`` announces: the job's first, within the size limit."""
        size = int(header["size"])
        with self._lock:
            refused = self._blob_started or size < 0 or (self.max_blob_bytes is not None and size > self.max_blob_bytes)
            self._blob_started = True
        if refused:
            logger.warning("the driver's channel refused a blob of %d bytes (one per job, at most %s bytes)", size,
                           self.max_blob_bytes)
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


def limit_waits(sock: socket.socket, seconds: float) -> None:
    """Makes ``sock`` blocking (as ``Connection`` needs) with reads and writes that give up
    after ``seconds`` (0: never)."""
    sock.setblocking(True)
    limit = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


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
        sock = socket.create_connection(tuple(address), timeout=connect_timeout)
        limit_waits(sock, connect_timeout)
        self._connection = Connection(sock.detach())
        answer_challenge(self._connection, secret)
        deliver_challenge(self._connection, secret)
        self._secret = secret
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        """Sends one JSON message; drops the channel on the first error."""
        if self._connection is None:
            return
        try:
            with self._lock:
                self._connection.send_bytes(json.dumps(message, default=_plain).encode())
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
        header = {"type": "blob", "key": key, "size": len(view), "sha256": hashlib.sha256(view).hexdigest()}
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
                return header["sha256"]
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
        self.client.send({"type": "log", "rank": self.rank, "level": record.levelno, "logger": record.name,
                          "message": record.getMessage(), "time": time.time()})


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

    def step(self, progress: Any, loss: Any, steps_per_epoch: int) -> None:
        """Reports the position after a step, at most every ``interval`` seconds."""
        if self.client is None:
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        self.client.send({"type": "progress", **progress.to_dict(), "steps_per_epoch": steps_per_epoch,
                          "loss": float(loss), "time": time.time()})

    def epoch(self, entry: dict) -> None:
        """Reports a finished epoch's history entry."""
        if self.client is not None:
            self.client.send({"type": "epoch", "entry": entry, "time": time.time()})

    def note(self, logger_name: str, message: str) -> None:
        """Logs ``message`` at INFO on the driver, once (rank 0's log forwarder sends warnings only)."""
        if self.client is not None:
            self.client.send({"type": "log", "rank": 0, "level": logging.INFO, "logger": logger_name,
                              "message": message, "time": time.time()})
