"""[both] A TCP server that serves only connections proving they hold a job's secret: the base of
the driver's channel (:mod:`spark_torch_est.cluster.channel`) and of the gate in front of its
rendezvous store (:mod:`spark_torch_est.cluster.store_gate`)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

__all__ = ["AuthenticatingServer", "limit_waits"]

logger = logging.getLogger(__name__)

_MAX_PENDING = 32


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
        # The kernel's whole backlog: under a flood of connections a rank's connect completes
        # while the accept loop catches up, instead of waiting out SYN retransmits (1 s, 2 s, ...).
        self._socket.listen(socket.SOMAXCONN)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        self._connections: list[Connection] = []
        self._pending: dict[socket.socket, float] = {}  # authenticating connections, by when they came
        self._served: list[threading.Thread] = []  # one per connection: joined by close()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="spark_torch_est-channel", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._socket.accept()
            except OSError:  # closed (the loop ends), or out of descriptors for now: not a busy loop
                self._closed.wait(0.05)
                continue
            if self._closed.is_set():
                sock.close()
                break
            with self._lock:
                if len(self._pending) >= _MAX_PENDING:  # the oldest gives way: a rank's handshake takes
                    oldest = min(self._pending, key=self._pending.__getitem__)  # milliseconds, a stalling one seconds
                    self._refuse(oldest, "too many connections were authenticating at once; dropped the oldest")
                # One deadline for the whole handshake, however slowly the peer drips bytes:
                deadline = threading.Timer(self.handshake_timeout, self._expire, args=(sock,))
                self._pending[sock] = time.monotonic()
                served = threading.Thread(target=self._serve, args=(sock, deadline),
                                          name="spark_torch_est-channel-reader", daemon=True)
                self._served = [thread for thread in self._served if thread.is_alive()] + [served]
            deadline.daemon = True
            deadline.start()
            served.start()

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

    def _drop(self, connection: Connection) -> None:
        """Closes an authenticated connection once, whichever of its server thread and
        :meth:`close` comes first: closing one descriptor twice from two threads fails, or
        closes whatever the number was given to meanwhile."""
        with self._lock:
            if connection not in self._connections:
                return
            self._connections.remove(connection)
        connection.close()

    def _end_served(self) -> None:
        """Ends what the connections' threads serve, for :meth:`close` to join them (callers
        hold the lock)."""

    def close(self) -> None:
        """Stops accepting, ends every connection and joins the server's threads (a fit
        leaves none behind)."""
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
            self._connections.clear()
            for sock in self._pending:  # a handshake in progress: its reads return at once
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._end_served()
            served = list(self._served)
        deadline = time.monotonic() + 5
        for thread in served:
            thread.join(max(0.0, deadline - time.monotonic()))


def limit_waits(sock: socket.socket, seconds: float) -> None:
    """Makes ``sock`` blocking (as ``Connection`` needs) with reads and writes that give up
    after ``seconds`` (0: never)."""
    sock.setblocking(True)
    limit = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
