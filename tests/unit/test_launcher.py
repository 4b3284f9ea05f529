"""The driver's side of a job's failures: the reports the ranks send it."""

import json
from multiprocessing.connection import Client

import torch.distributed as dist

from spark_torch_est.cluster.channel import ChannelServer
from spark_torch_est.cluster.failure import USER, Failure
from spark_torch_est.cluster.store_gate import StoreGate
from spark_torch_est.cluster.worker import _report
from spark_torch_est.core.spec import Launch

LAUNCH = Launch(job_id="ste-abc", secret=b"j" * 32)


def test_the_driver_keeps_only_reports_sealed_with_the_jobs_secret():
    channel = ChannelServer("127.0.0.1", LAUNCH.secret, lambda message: None)
    try:
        launch = Launch(LAUNCH.job_id, LAUNCH.secret, channel_address=channel.address)
        genuine = Failure(USER, "ValueError: x", 1, "after_train_iter", hook="h")
        _report(launch, genuine)  # returns once the driver holds it
        forged = Failure(USER, "attacker's text", 0, "setup")
        with Client(channel.address, authkey=LAUNCH.secret) as client:  # a peer with the secret, a bad seal
            client.send_bytes(json.dumps({"type": "failure", "report": forged.seal(b"not the secret")}).encode())
            assert json.loads(client.recv_bytes())["type"] == "ack"
        assert channel.failures() == [genuine]
    finally:
        channel.close()


def test_a_failure_report_never_reaches_the_store_and_a_client_without_the_secret_reads_nothing(caplog):
    """The reports' messages and tracebacks travel over the authenticated channel only: the
    rendezvous store, which every rank's client reaches, holds none of their text."""
    gate = StoreGate("127.0.0.1", LAUNCH.secret, max_connections=2, timeout_s=10)
    channel = ChannelServer("127.0.0.1", LAUNCH.secret, lambda message: None)
    try:
        launch = Launch(LAUNCH.job_id, LAUNCH.secret, store_address=gate.address, channel_address=channel.address)
        _report(launch, Failure(USER, "ValueError: SECRET-TEXT of the model", 1, "setup", traceback="SECRET-TB"))
        assert [f.message for f in channel.failures()] == ["ValueError: SECRET-TEXT of the model"]
        values = [gate.store.get(key) for key in gate.store.list_keys()]
        assert not any(b"SECRET" in value for value in values)
        try:  # nor can a client without the secret read the store or the channel at all
            dist.TCPStore("127.0.0.1", gate.address[1], is_master=False, timeout=_seconds(2)).list_keys()
            raise AssertionError("an outsider read the store")
        except dist.DistError:
            pass
    finally:
        channel.close()
        gate.close()


def _seconds(n: float):
    from datetime import timedelta

    return timedelta(seconds=n)


def test_a_relaunch_resumes_only_from_a_checkpoint_this_fit_wrote(tmp_path):
    import torch

    from spark_torch_est.checkpoints.checkpoint import Checkpoint
    from spark_torch_est.checkpoints.storage import CheckpointDir
    from spark_torch_est.cluster.launcher import Launcher
    from spark_torch_est.core import rng
    from spark_torch_est.core.progress import Progress, Target
    from tests.helpers import features_schema, task_spec

    def checkpoint(fit_id: str, step: int) -> bytes:
        return Checkpoint.build(
            run_id="0123456789abcdef", fit_id=fit_id, progress=Progress(epoch=step // 10, global_step=step), history=[],
            partial_loss=(0.0, 0.0), epoch_rows=10, world_size=2, data_source="spark", seed=0, optimizer_made=[],
            output_shape=[1], label_kind="float", input_schema=features_schema(8).to_dict(), input_rows=[[8]],
            model={"w": torch.zeros(1)}, optimizer={"state": {}, "param_groups": []}, scheduler=None,
            rng=[rng.capture(torch.device("cpu"))], hooks={}).to_bytes()

    spec = task_spec(Target(epoch=9), fit_id="this", checkpoint_dir=str(tmp_path), resume=checkpoint("earlier", 20))
    directory = CheckpointDir(str(tmp_path), run_id="0123456789abcdef")
    directory.write(checkpoint("another", 80), epoch=8, global_step=80)  # another fit's future of the run
    launcher = Launcher(None, None, max_retries=1, slot_wait_s=1)
    assert launcher._relaunch_spec(spec, Progress(epoch=2, global_step=20))[0].resume == spec.resume
    directory.write(checkpoint("this", 30), epoch=3, global_step=30)  # this fit's own
    relaunched, start = launcher._relaunch_spec(spec, Progress(epoch=2, global_step=20))
    assert start.global_step == 30 and Checkpoint.from_bytes(relaunched.resume).fit_id == "this"


def test_a_fit_rerouted_through_allgather_leaves_the_next_fit_on_the_store():
    """The reroute is decided per fit: a store unreachable once (descriptors exhausted by
    idle connections, say) does not send every later fit of the session through allGather."""
    from spark_torch_est.cluster.launcher import Launcher

    rerouted = Launcher(None, None, max_retries=1, slot_wait_s=1)
    rerouted._store_unreachable.add("127.0.0.1")
    assert Launcher(None, None, max_retries=1, slot_wait_s=1)._store_unreachable == set()


def test_a_shrunk_run_grows_at_its_first_checkpoint_once_the_slots_are_back_at_most_once_per_slot_wait(tmp_path):
    """The driver's side of growing back (the standalone kills in test_cluster run it for
    real): a checkpoint written while the slots are still missing is no reason to grow, the
    first one written after they return is, slots that go again before it start the wait
    anew, and a fit grows at most once per slotWaitTimeout."""
    import time

    from spark_torch_est.checkpoints.storage import CheckpointDir
    from spark_torch_est.cluster.launcher import Launcher, _GrowWatch
    from spark_torch_est.core.progress import Interval, Target
    from tests.helpers import task_spec

    directory = CheckpointDir(str(tmp_path), run_id="0123456789abcdef")
    directory.write(b"step 10", epoch=0, global_step=10)
    watch = _GrowWatch(None, 2, directory)
    assert watch.ready(1) is None                                    # still shrunk
    directory.write(b"step 20", epoch=0, global_step=20)
    assert watch.ready(1) is None                                    # a checkpoint, but no slots for 2 ranks
    assert watch.ready(2) is None and watch.ready(2) is None         # back: the run trains on to its next checkpoint
    directory.write(b"step 30", epoch=0, global_step=30)
    assert "global step 30" in watch.ready(2)

    again = _GrowWatch(None, 2, directory)
    assert again.ready(2) is None                                    # back at step 30 ...
    directory.write(b"step 40", epoch=0, global_step=40)
    assert again.ready(1) is None                                    # ... gone before the checkpoint of step 40
    assert again.ready(2) is None                                    # back again, now after step 40
    directory.write(b"step 50", epoch=0, global_step=50)
    assert "global step 50" in again.ready(2)

    shrunk = task_spec(Target(epoch=9), world_size=1, checkpoint_dir=str(tmp_path), checkpoint_every=Interval(10, "ba"))
    launcher = Launcher(None, None, max_retries=0, slot_wait_s=60)
    assert isinstance(launcher._grow_watch(shrunk, 2), _GrowWatch)
    assert launcher._grow_watch(shrunk, 1) is None                   # not shrunk
    assert launcher._grow_watch(task_spec(Target(epoch=9), world_size=1, checkpoint_dir=str(tmp_path)), 2) is None
    launcher._grown_at = time.monotonic()                            # it grew back just now
    assert launcher._grow_watch(shrunk, 2) is None
    launcher._grown_at = time.monotonic() - 61
    assert isinstance(launcher._grow_watch(shrunk, 2), _GrowWatch)
