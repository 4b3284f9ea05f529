"""[both] The driver's rendezvous store behind a gate that only the job's ranks pass.

torch's ``TCPStore`` has no authentication and no limits: whoever reaches its port can
read every key, write values of any size into the process that hosts it, and hold any
number of connections open. So the driver binds its store to loopback, where the
network cannot reach it, and listens on the driver host with a :class:`StoreGate`: a
connection first proves it holds the job's secret (the channel's HMAC handshake, within
5 s, at most 32 at once, see :class:`~spark_torch_est.cluster.authenticated.AuthenticatingServer`),
and only then are its bytes relayed to the store, one connection per rank at most.

A rank's ``TCPStore`` client cannot do that handshake, so each rank opens a relay of its
own (:func:`open_relay`): it authenticates to the gate, then listens on the executor's
loopback for the client's one connection, from its own process (Linux), and copies bytes
both ways.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from spark_torch_est.cluster.authenticated import AuthenticatingServer, limit_waits

__all__ = ["StoreGate", "open_relay", "listening_store"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 16


def listening_store(host: str, world_size: int | None, timeout_s: float) -> tuple[Any, tuple[str, int]]:
    """A ``TCPStore`` server on ``host`` only, on a port it never has to pick (the socket is
    bound first and handed over: no pick-then-bind race); returns it and its address.

    torch 2.4 to 2.8's default libuv backend cannot take a bound socket
    (``NotImplementedError``); the legacy backend can, and is what those versions then use.
    """
    import torch.distributed as dist

    listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listening.bind((host, 0))  # this host only: torch's own listener would take every interface
    listening.listen(256)
    address = listening.getsockname()[:2]
    timeout = timedelta(seconds=timeout_s)
    try:
        try:
            store = dist.TCPStore(host, address[1], world_size, True, timeout, wait_for_workers=False,
                                  master_listen_fd=listening.fileno())
        except NotImplementedError:
            store = dist.TCPStore(host, address[1], world_size, True, timeout, wait_for_workers=False,
                                  master_listen_fd=listening.fileno(), use_libuv=False)
    except BaseException:
        listening.close()
        raise
    listening.detach()  # the store owns the descriptor now and closes it
    return store, address


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

        loopback = "::1" if ":" in host else "127.0.0.1"
        self.store, self._store_address = listening_store(loopback, None, timeout_s)
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
            self._drop(connection)
            return
        self._drop(connection)  # rank_side holds the socket now
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
        listening.listen(8)
    except BaseException:
        gate.close()
        raise

    def serve() -> None:
        try:
            client = _accept_own(listening, timeout_s)
        except OSError:
            gate.close()
            return
        finally:
            listening.close()  # one client: nobody else gets in through it
        client.settimeout(None)
        try:
            _relay(client, gate)
        finally:
            client.close()
            gate.close()

    threading.Thread(target=serve, name="spark_torch_est-store-relay", daemon=True).start()
    return listening.getsockname()[:2]


def _accept_own(listening: socket.socket, timeout_s: float) -> socket.socket:
    """The first connection to ``listening`` made from this process (the rank's own
    ``TCPStore`` client) within ``timeout_s``; connections from other processes on the
    host are closed (another local user would otherwise get the rank's authenticated path
    to the store).

    Raises:
        OSError: None came in time (``socket.timeout``).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        listening.settimeout(max(0.001, deadline - time.monotonic()))
        client, _ = listening.accept()
        if _from_this_process(client):
            return client
        logger.warning("refused a connection to this rank's store relay: it came from another process")
        client.close()


def _from_this_process(client: socket.socket) -> bool:
    """Whether the peer of the loopback connection ``client`` is a socket this process
    holds: the kernel's socket table (``/proc/net/tcp``) gives the peer's inode, this
    process's descriptors (``/proc/self/fd``) the inodes it holds. Without ``/proc`` (not
    Linux) every connection is taken, as before."""
    peer_port, own_port = client.getpeername()[1], client.getsockname()[1]
    inodes = set()
    try:
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):  # a client may connect from an IPv6 socket
            with contextlib.suppress(FileNotFoundError), open(name) as table:
                for line in table.readlines()[1:]:
                    fields = line.split()
                    local, remote, inode = fields[1], fields[2], fields[9]
                    if int(local.rsplit(":", 1)[1], 16) == peer_port and int(remote.rsplit(":", 1)[1], 16) == own_port:
                        inodes.add(f"socket:[{inode}]")
        held = set()
        for descriptor in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                held.add(os.readlink(f"/proc/self/fd/{descriptor}"))
    except OSError:
        return True
    return bool(inodes & held)


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
