import hashlib
import json
import logging
import time
from multiprocessing.connection import AuthenticationError

import pytest

from spark_torch_est.cluster.channel import ChannelClient, ChannelServer
from spark_torch_est.cluster.messages import Kind, RankMessage
from spark_torch_est.core.progress import Progress

SECRET = b"c" * 32


def _step(global_step: int) -> RankMessage:
    return RankMessage.for_step(Progress(global_step=global_step), 0.5, steps_per_epoch=10)


def _epoch(epoch: int = 1) -> RankMessage:
    return RankMessage.for_epoch({"epoch": epoch, "train_loss": 0.25})


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.fixture
def rank_channel():
    """A driver's server, an authenticated rank's client, and the messages received."""
    received = []
    server = ChannelServer("127.0.0.1", SECRET, received.append)
    client = ChannelClient(server.address, server.secret)
    yield server, client, received
    client.close()
    server.close()


def test_messages_from_an_authenticated_rank_arrive(rank_channel):
    _, client, received = rank_channel
    sent = _step(1)
    client.send(sent)
    assert _wait_for(lambda: received == [sent])


def test_a_message_the_driver_cannot_read_is_dropped_and_the_next_one_arrives(rank_channel, caplog):
    _, client, received = rank_channel
    malformed = [{"type": "epoch", "entry": {"train_loss": 0.5}, "time": 0.0}, {"type": "progress", "time": 0.0},
                 {"type": "log", "rank": "0", "level": 30, "logger": "x", "message": "m", "time": 0.0},
                 {"type": "ack", "time": 0.0}, [1, 2], "text"]
    with caplog.at_level(logging.DEBUG, logger="spark_torch_est.cluster.channel"):
        for message in malformed:
            client._connection.send_bytes(json.dumps(message).encode())
        sent = _epoch()
        client.send(sent)
        assert _wait_for(lambda: received == [sent])
    assert [r.levelno for r in caplog.records if "dropped a message" in r.getMessage()] == [logging.DEBUG] * 6


def test_a_connection_without_the_secret_is_refused_and_reads_nothing():
    received = []
    server = ChannelServer("127.0.0.1", SECRET, received.append)
    try:
        with pytest.raises((AuthenticationError, OSError)):
            ChannelClient(server.address, b"wrong secret").send(RankMessage.for_log(0, logging.WARNING, "x", "y"))
        assert _wait_for(lambda: server.rejected == 1)
        good = ChannelClient(server.address, server.secret)  # the server still serves
        good.send(_epoch())
        assert _wait_for(lambda: len(received) == 1 and received[0].kind is Kind.EPOCH)
        good.close()
    finally:
        server.close()


def test_the_server_binds_only_the_host_it_was_given():
    server = ChannelServer("127.0.0.1", SECRET, lambda message: None)
    try:
        assert server.address[0] == "127.0.0.1"
    finally:
        server.close()


def test_an_unreachable_driver_fails_fast():
    server = ChannelServer("127.0.0.1", SECRET, lambda message: None)
    address = server.address
    server.close()
    started = time.monotonic()
    with pytest.raises(OSError):
        ChannelClient(address, b"x", connect_timeout=2)
    assert time.monotonic() - started < 5


def test_numbers_hooks_put_in_metrics_travel_as_floats():
    import numpy as np
    import torch

    received = []
    server = ChannelServer("127.0.0.1", SECRET, received.append)
    try:
        client = ChannelClient(server.address, server.secret)
        client.send(RankMessage.for_epoch({"epoch": 1, "grad_norm": torch.tensor(2.5), "lr": np.float32(0.5)}))
        assert _wait_for(lambda: [m.entry for m in received] == [{"epoch": 1, "grad_norm": 2.5, "lr": 0.5}])
        client.close()
    finally:
        server.close()


def test_silent_connections_that_come_back_when_dropped_do_not_lock_the_ranks_out():
    """More silent connections than may authenticate at once, each reopened as soon as the
    server drops it, and one that drips a byte at a time: ranks still get in at once."""
    import socket
    import threading

    received = []
    server = ChannelServer("127.0.0.1", SECRET, received.append, handshake_timeout=2.0)
    stop, connected = threading.Event(), threading.Event()

    def attacker():
        sockets = [socket.create_connection(server.address) for _ in range(40)]
        for sock in sockets:
            sock.settimeout(0.05)
        connected.set()
        while not stop.is_set():
            for i, sock in enumerate(sockets):
                try:
                    if sock.recv(1 << 16) == b"":  # dropped: come back
                        sock.close()
                        sockets[i] = socket.create_connection(server.address)
                        sockets[i].settimeout(0.05)
                except (TimeoutError, OSError):
                    pass
            try:
                sockets[0].send(b"x")  # a drip that never completes a handshake
            except OSError:
                pass
        for sock in sockets:
            sock.close()

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    try:
        assert connected.wait(10), "the attacker's 40 connections are open before any rank connects"
        for step in range(3):
            started = time.monotonic()
            client = ChannelClient(server.address, server.secret)
            sent = _step(step)
            client.send(sent)
            assert _wait_for(lambda sent=sent: sent in received, seconds=2.0)
            assert time.monotonic() - started < 2.0
            client.close()
        assert server.rejected > 0
    finally:
        stop.set()
        thread.join(10)
        server.close()


def test_a_checkpoint_crosses_the_channel_in_parts_and_is_acknowledged(rank_channel):
    server, client, received = rank_channel
    blob = bytes(range(256)) * (40 * 4096 + 7)  # ~42 MB: three parts, the last one short
    client.send(_step(3))
    digest = client.send_blob("job-1", blob)
    client.send(_epoch())  # the channel stays usable
    assert digest == hashlib.sha256(blob).hexdigest()
    assert server.take_blob("job-1", "0" * 64) is None, "a blob is handed out only under its own digest"
    assert server.take_blob("job-1", digest) == blob
    assert server.take_blob("job-1", digest) is None, "taken once"
    assert _wait_for(lambda: len(received) == 2) and received[1].kind is Kind.EPOCH


def test_a_damaged_checkpoint_is_refused_and_not_kept(rank_channel):
    server, client, _ = rank_channel
    connection = client._connection  # a rank whose bytes do not match the digest it announced
    connection.send_bytes(json.dumps({"type": "blob", "key": "job-1", "size": 3, "sha256": "0" * 64}).encode())
    connection.send_bytes(b"abc")
    assert json.loads(connection.recv_bytes()) == {"type": "nack", "key": "job-1"}
    assert server.take_blob("job-1", "0" * 64) is None
    assert server.take_blob("job-1", hashlib.sha256(b"abc").hexdigest()) is None


def test_a_checkpoint_the_driver_does_not_acknowledge_is_not_delivered(rank_channel):
    server, client, _ = rank_channel
    server._receive_blob = lambda connection, header: None  # reads nothing, answers nothing
    assert client.send_blob("job-1", b"x" * 1000, ack_timeout=0.5) is None
    assert client.send_blob("job-1", b"x") is None, "the channel is closed after a failed send"


def test_json_nested_too_deep_drops_only_its_connection(rank_channel):
    server, client, received = rank_channel
    client._connection.send_bytes(b"[" * 100_000 + b"]" * 100_000)
    assert client._connection.poll(10)  # the driver closed that connection (its reader did not just die)
    with pytest.raises((EOFError, OSError)):
        client._connection.recv_bytes()
    other = ChannelClient(server.address, server.secret)
    sent = _epoch()
    other.send(sent)
    assert _wait_for(lambda: received == [sent])
    other.close()


def test_one_blob_per_job_within_the_size_limit():
    server = ChannelServer("127.0.0.1", SECRET, lambda message: None, max_blob_bytes=1000)
    try:
        assert ChannelClient(server.address, SECRET).send_blob("job-1", b"x" * 1001, ack_timeout=5) is None
        first = ChannelClient(server.address, SECRET)
        assert first.send_blob("job-1", b"y" * 1000, ack_timeout=5) is None  # the job's one blob was announced
    finally:
        server.close()
    server = ChannelServer("127.0.0.1", SECRET, lambda message: None, max_blob_bytes=1000)
    try:
        digest = ChannelClient(server.address, SECRET).send_blob("job-1", b"y" * 1000, ack_timeout=5)
        assert server.take_blob("job-1", digest) == b"y" * 1000
        assert ChannelClient(server.address, SECRET).send_blob("job-1", b"z" * 10, ack_timeout=5) is None
        assert server.take_blob("job-1", hashlib.sha256(b"z" * 10).hexdigest()) is None
    finally:
        server.close()


def test_a_job_of_several_runs_may_send_a_blob_for_each_and_no_more():
    server = ChannelServer("127.0.0.1", SECRET, lambda message: None, max_blobs=3)
    try:
        client = ChannelClient(server.address, SECRET)
        digests = [client.send_blob(f"job-1/run{run}", bytes([run]) * 10, ack_timeout=5) for run in range(3)]
        assert all(digests)
        assert [server.take_blob(f"job-1/run{run}", digests[run]) for run in range(3)] == [
            bytes([run]) * 10 for run in range(3)]
        assert ChannelClient(server.address, SECRET).send_blob("job-1", b"z", ack_timeout=5) is None
    finally:
        server.close()


def test_a_note_from_rank_0_reaches_the_drivers_log_once_and_other_ranks_send_none(rank_channel, caplog):
    import logging

    from spark_torch_est.cluster.channel import ProgressReporter
    from spark_torch_est.loggers.view import DriverView

    _, client, received = rank_channel
    ProgressReporter(client, rank=1).note("spark_torch_est.train.loop", "from rank 1")
    ProgressReporter(client, rank=0).note("spark_torch_est.train.loop", "compileModel: took 4.9s")
    assert _wait_for(lambda: len(received) == 1)
    view = DriverView(False, None, None, 1)
    with caplog.at_level(logging.INFO, logger="spark_torch_est.worker"):
        view.handle(received[0])
    view.close()
    assert caplog.messages == ["[rank 0] spark_torch_est.train.loop: compileModel: took 4.9s"]


def test_rank_0_asks_whether_to_stop_after_an_epoch_and_gets_the_drivers_answer():
    asked = []

    def on_ask(epoch):
        asked.append(epoch)
        return epoch >= 2

    server = ChannelServer("127.0.0.1", SECRET, lambda message: None, on_ask=on_ask)
    client = ChannelClient(server.address, server.secret)
    try:
        assert client.ask_stop(1, timeout=5.0) is False
        assert client.ask_stop(2, timeout=5.0) is True
        assert asked == [1, 2]
        client.send(_epoch(3))  # the channel still carries messages after the answers
        assert client.send_blob("job-1", b"x" * 100) == hashlib.sha256(b"x" * 100).hexdigest()
    finally:
        client.close()
        server.close()


def test_no_answer_in_time_goes_on_and_closes_the_channel(caplog):
    import threading

    release = threading.Event()
    server = ChannelServer("127.0.0.1", SECRET, lambda message: None, on_ask=lambda epoch: release.wait(30))
    client = ChannelClient(server.address, server.secret)
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="spark_torch_est.cluster.channel"):
            assert client.ask_stop(1, timeout=0.5) is False
        assert time.monotonic() - started < 5
        assert "did not say whether to stop after epoch 1" in caplog.text
        assert client.send_blob("job-1", b"x") is None, "a late answer can never be read as the blob's acknowledgement"
    finally:
        release.set()
        client.close()
        server.close()


def test_rank_0_sends_its_position_after_the_first_step_at_once_then_at_most_once_an_interval(rank_channel):
    """The loop reads its losses every 10 steps: without positions between readings a bar sat
    at 10/120 and jumped to 100%, and nothing came before the tenth step."""
    from spark_torch_est.cluster.channel import ProgressReporter

    _, client, received = rank_channel
    reporter = ProgressReporter(client, rank=0, interval=0.3)
    for step in range(1, 50):  # fast steps
        reporter.position(Progress(batch_in_epoch=step, global_step=step), 100)
    assert _wait_for(lambda: len(received) == 1)
    assert received[0].kind is Kind.POSITION and received[0].progress.global_step == 1  # the first step, at once
    time.sleep(0.35)  # the interval passes while steps run
    reporter.position(Progress(batch_in_epoch=50, global_step=50), 100)
    assert _wait_for(lambda: len(received) == 2) and received[1].progress.global_step == 50
    ProgressReporter(client, rank=1).position(Progress(global_step=1), 100)  # other ranks send nothing
    time.sleep(0.2)
    assert len(received) == 2


def test_the_next_runs_first_position_goes_at_once_after_a_run_ends(rank_channel):
    from spark_torch_est.cluster.channel import ProgressReporter
    from spark_torch_est.core.progress import Progress

    _, client, received = rank_channel
    reporter = ProgressReporter(client, rank=0, interval=60.0)
    reporter.position(Progress(global_step=1), 10)
    reporter.position(Progress(global_step=2), 10)  # within the interval: not sent
    reporter.run_done(0, Progress(epoch=1, global_step=10), "")
    reporter.position(Progress(global_step=1), 10)  # the next run's first step
    assert _wait_for(lambda: len(received) == 3)
    assert [(m.kind.value, m.progress.global_step) for m in received] == [
        ("position", 1), ("run_done", 10), ("position", 1)]
