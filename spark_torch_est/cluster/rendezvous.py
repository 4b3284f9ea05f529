"""[executor] How the ranks of a job find each other and prove they belong to it.

The store is the driver's ``TCPStore``, which a rank reaches through a relay that proves
the job's secret to the driver's gate (:mod:`spark_torch_est.cluster.store_gate`), or, when
executors cannot reach the driver, one rank 0 opens. That one has no authentication, as
every torch.distributed store: anyone who reaches its port can read its keys and join the
process group in a rank's place. So once the group is formed, every rank proves it holds
the job's secret (an HMAC over nonces all ranks contributed) before any other collective;
a member that cannot fails the job at once. Only tensors cross the group, never pickles.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from multiprocessing import AuthenticationError

import torch
import torch.distributed as dist

from spark_torch_est.cluster.barrier import Barrier
from spark_torch_est.cluster.failure import PeerAuthenticationError, StoreUnreachableError
from spark_torch_est.cluster.store_gate import listening_store, open_relay
from spark_torch_est.core.spec import Launch

__all__ = ["connect_store", "authenticate_peers", "parse_address"]

_NONCE_BYTES = 32


def connect_store(launch: Launch, barrier: Barrier, timeout_s: float) -> dist.Store:
    """Joins the driver's TCPStore through its gate, or, without one, a store rank 0 opens
    and announces with one ``allGather``; returns it under the job's prefix.

    Raises:
        StoreUnreachableError: The driver's store did not answer.
    """
    timeout = timedelta(seconds=timeout_s)
    if launch.store_address is not None:
        host, port = launch.store_address
        connect_s = min(timeout_s, 30.0)
        try:
            relay = open_relay((host, port), launch.secret, connect_s)
            store = dist.TCPStore(relay[0], relay[1], is_master=False, timeout=timedelta(seconds=connect_s))
        except (RuntimeError, dist.DistError, OSError, EOFError, AuthenticationError) as error:
            raise StoreUnreachableError(f"cannot reach the driver's rendezvous store at {host}:{port}: {error}",
                                        retryable=True) from None
        store.set_timeout(timeout)
        return dist.PrefixStore(launch.job_id, store)
    if barrier.rank == 0:
        host = barrier.host()
        store, _ = listening_store(host, barrier.world_size, timeout_s)
        barrier.all_gather(f"{host}:{store.port}")
    else:
        host, port = parse_address(barrier.all_gather("")[0])
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(launch.job_id, store)


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` as announced by rank 0, checked.

    Raises:
        ValueError: Not a host and a TCP port.
    """
    host, _, port = text.rpartition(":")
    if not host or len(host) > 255 or any(c.isspace() for c in host) or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise ValueError(f"rank 0 announced an invalid store address {text[:100]!r}")
    return host, int(port)


def authenticate_peers(secret: bytes, rank: int, world_size: int, device: torch.device) -> None:
    """Checks that every member of the default process group holds ``secret``.

    Each rank draws a nonce; all nonces are gathered; each rank then sends
    ``HMAC(secret, rank || nonces)`` and checks everyone else's. Replaying another job's
    proof fails (fresh nonces), and computing one needs the secret.

    Raises:
        PeerAuthenticationError: A member could not prove it holds the secret.
    """
    if world_size == 1:
        return
    nonce = torch.frombuffer(bytearray(secrets.token_bytes(_NONCE_BYTES)), dtype=torch.uint8)
    nonces = _all_gather(nonce, world_size, device)
    challenge = b"".join(bytes(n.tolist()) for n in nonces)
    proofs = _all_gather(torch.frombuffer(bytearray(_proof(secret, rank, challenge)), dtype=torch.uint8),
                         world_size, device)
    impostors = [peer for peer, proof in enumerate(proofs)
                 if not hmac.compare_digest(bytes(proof.tolist()), _proof(secret, peer, challenge))]
    if impostors:
        raise PeerAuthenticationError(
            f"rank(s) {impostors} of the process group could not prove they hold this job's secret: a process "
            "outside the Spark job joined the rendezvous (is the driver's rendezvous port reachable from outside "
            "the cluster?)"
        )


def _proof(secret: bytes, rank: int, challenge: bytes) -> bytes:
    return hmac.new(secret, rank.to_bytes(4, "big") + challenge, hashlib.sha256).digest()


def _all_gather(tensor: torch.Tensor, world_size: int, device: torch.device) -> list[torch.Tensor]:
    local = tensor.to(device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    return [g.cpu() for g in gathered]
