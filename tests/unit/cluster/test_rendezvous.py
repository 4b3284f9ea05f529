"""Ranks prove to each other that they hold the job's secret before any other collective."""

from __future__ import annotations

import pytest

from spark_torch_est.cluster.rendezvous import parse_address
from tests.helpers import leave_group, rank_processes


def _rank(rank: int, secret: bytes, store_path: str, results) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from spark_torch_est.cluster.rendezvous import authenticate_peers

    try:  # whatever fails is reported to the test, which would otherwise wait for a result
        dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                                timeout=timedelta(seconds=20))
        authenticate_peers(secret, rank, 2, torch.device("cpu"))
        results.put((rank, "ok"))
    except Exception as error:
        results.put((rank, f"{type(error).__name__}: {error}"))
    finally:
        leave_group()


def _meet(store: str, secrets: tuple[bytes, bytes]) -> dict[int, str]:
    context = rank_processes()
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(r, secrets[r], store, results))
                 for r in range(2)]
    for process in processes:
        process.start()
    outcome = dict(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(30)
    return outcome


def test_members_holding_the_secret_pass_and_an_impostor_is_named_by_both(tmp_path):
    # a store file each: the first meeting's may still be in use by its exiting ranks
    assert _meet(str(tmp_path / "store-1"), (b"s" * 32, b"s" * 32)) == {0: "ok", 1: "ok"}
    outcome = _meet(str(tmp_path / "store-2"), (b"s" * 32, b"guess" * 7))
    assert outcome[0].startswith("PeerAuthenticationError: rank(s) [1]")
    assert outcome[1].startswith("PeerAuthenticationError: rank(s) [0]")


@pytest.mark.parametrize("text", ["", "host", "host:", ":80", "host:0", "host:70000", "ho st:80", "host:8a"])
def test_a_store_address_announced_by_rank_0_is_checked(text):
    with pytest.raises(ValueError):
        parse_address(text)


def test_a_good_store_address_parses():
    assert parse_address("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert parse_address("fe80::1:5000") == ("fe80::1", 5000)
