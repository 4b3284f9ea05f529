import time
from multiprocessing.connection import AuthenticationError

import pytest

from spark_torch_est.channel import ChannelClient, ChannelServer


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_messages_from_an_authenticated_rank_arrive():
    received = []
    server = ChannelServer("127.0.0.1", received.append)
    try:
        client = ChannelClient(server.address, server.secret)
        client.send({"type": "progress", "global_step": 1})
        assert _wait_for(lambda: received == [{"type": "progress", "global_step": 1}])
        client.close()
    finally:
        server.close()


def test_a_connection_without_the_secret_is_refused_and_reads_nothing():
    received = []
    server = ChannelServer("127.0.0.1", received.append)
    try:
        with pytest.raises((AuthenticationError, OSError)):
            ChannelClient(server.address, b"wrong secret").send({"type": "log"})
        assert _wait_for(lambda: server.rejected == 1)
        good = ChannelClient(server.address, server.secret)  # the server still serves
        good.send({"type": "epoch"})
        assert _wait_for(lambda: received == [{"type": "epoch"}])
        good.close()
    finally:
        server.close()


def test_the_server_binds_only_the_host_it_was_given():
    server = ChannelServer("127.0.0.1", lambda message: None)
    try:
        assert server.address[0] == "127.0.0.1"
    finally:
        server.close()


def test_an_unreachable_driver_fails_fast():
    server = ChannelServer("127.0.0.1", lambda message: None)
    address = server.address
    server.close()
    started = time.monotonic()
    with pytest.raises(OSError):
        ChannelClient(address, b"x", connect_timeout=2)
    assert time.monotonic() - started < 5
