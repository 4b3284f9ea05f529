"""[both] The driver's rendezvous store behind a gate that only the job's ranks pass.

torch's ``TCPStore`` has no authentication and no limits: whoever reaches its port can
read every key, write values of any size into the process that hosts it, and hold any
number of connections open. So the driver binds its store to loopback, where the
network cannot reach it, and listens on the driver host with a :class:`StoreGate`: a
connection first proves it holds the job's secret (the channel's HMAC handshake, within
5 s, at most 32 at once, see :class:`~spark_torch_est.authenticated.AuthenticatingServer`),
and only then are its bytes relayed to the store, one connection per rank at most.

A rank's ``TCPStore`` client cannot do that handshake, so each rank opens a relay of its
own (:func:`open_relay`): it authenticates to the gate, then listens on the executor's
loopback for the client's one connection and copies bytes both ways.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import timedelta
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from spark_torch_est.authenticated import AuthenticatingServer, limit_waits

__all__ = ["StoreGate", "open_relay"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 16


class StoreGate(AuthenticatingServer):
    """The job's ``TCPStore`` on the driver's loopback, and the gate to it on ``host``.

    Args:
        host: The address the ranks reach (the driver host; never all interfaces).
        secret: The job's key every connection must prove it holds.
        max_connections: Authenticated connections relayed at once (one per rank); one
            more is closed as soon as it authenticates.
        timeout_s: The store's timeout.

    Attributes:
        address: ``(host, port)`` of the gate, to give the ranks.
        store: The ``TCPStore`` itself (the driver's own client of it).
    """

    what = "the driver's rendezvous store"

    def __init__(self, host: str, secret: bytes, max_connections: int, timeout_s: float) -> None:
        import torch.distributed as dist

        loopback = "::1" if ":" in host else "127.0.0.1"
        listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listening.bind((loopback, 0))
        listening.listen(64)
        self._store_address = listening.getsockname()[:2]
        self.store = dist.TCPStore(loopback, self._store_address[1], None, True, timedelta(seconds=timeout_s),
                                   wait_for_workers=False, master_listen_fd=listening.fileno())
        listening.detach()  # the store owns the descriptor now and closes it
        self.max_connections = max_connections
        self._relays: set[socket.socket] = set()
        super().__init__(host, secret)

    def _serve_authenticated(self, connection: Connection) -> None:
        with self._lock:
            admitted = len(self._relays) < self.max_connections and not self._closed.is_set()
            if admitted:
                rank_side = socket.socket(fileno=os.dup(connection.fileno()))
                self._relays.add(rank_side)
            else:
                self.rejected += 1
        if not admitted:
            logger.warning("%s closed an authenticated connection: %d are open, one per rank", self.what,
                           self.max_connections)
            connection.close()
            return
        connection.close()  # rank_side holds the socket now
        try:
            store_side = socket.create_connection(self._store_address)
        except OSError as error:
            logger.warning("%s could not reach its own store: %s", self.what, error)
            store_side = None
        try:
            if store_side is not None:
                _relay(rank_side, store_side)
        finally:
            with self._lock:
                self._relays.discard(rank_side)
            rank_side.close()

    def _end_served(self) -> None:
        for sock in self._relays:
            _shut(sock)

    def close(self) -> None:
        """Closes the gate, every relayed connection and the store."""
        super().close()
        del self.store


def open_relay(address: tuple[str, int], secret: bytes, timeout_s: float) -> tuple[str, int]:
    """Authenticates to the gate at ``address``, then relays the first connection made to
    the returned loopback address (this rank's ``TCPStore`` client) to the gate, in a
    thread that ends when either side closes.

    Args:
        address: The gate's ``(host, port)``.
        secret: The job's key.
        timeout_s: Seconds to connect and authenticate, and for the client to connect.

    Raises:
        OSError, EOFError, multiprocessing.AuthenticationError: The gate is unreachable or
            refused the key.
    """
    gate = socket.create_connection(address, timeout=timeout_s)
    try:
        limit_waits(gate, timeout_s)
        connection = Connection(os.dup(gate.fileno()))
        try:
            answer_challenge(connection, secret)
            deliver_challenge(connection, secret)
        finally:
            connection.close()
        limit_waits(gate, 0)
        listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        listening.settimeout(timeout_s)
    except BaseException:
        gate.close()
        raise

    def serve() -> None:
        try:
            client, _ = listening.accept()
        except OSError:
            gate.close()
            return
        finally:
            listening.close()  # one client: nobody else on this host gets in through it
        client.settimeout(None)
        try:
            _relay(client, gate)
        finally:
            client.close()
            gate.close()

    threading.Thread(target=serve, name="spark_torch_est-store-relay", daemon=True).start()
    return listening.getsockname()[:2]


def _relay(one: socket.socket, other: socket.socket) -> None:
    """Copies bytes both ways between two connected sockets until either side ends."""
    back = threading.Thread(target=_copy, args=(other, one), name="spark_torch_est-store-relay", daemon=True)
    back.start()
    _copy(one, other)
    back.join()


def _copy(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(_CHUNK):
            target.sendall(data)
    except OSError:  # either side closed: end both directions
        pass
    _shut(source)
    _shut(target)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass
