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
        assert gate.store.num_keys() == 0  # nothing of it, text or not
        try:  # nor can a client without the secret read the store or the channel at all
            gate.store.set("ste-probe", b"v")
            dist.TCPStore("127.0.0.1", gate.address[1], is_master=False, timeout=_seconds(2)).get("ste-probe")
            raise AssertionError("an outsider read the store")
        except (RuntimeError, MemoryError):  # torch's DistError at the connection; torch 2.3's client at the read
            pass
    finally:
        channel.close()
        gate.close()


def _seconds(n: float):
    from datetime import timedelta

    return timedelta(seconds=n)


def checkpoint(fit_id: str, step: int) -> bytes:
    """A checkpoint of run ``0123456789abcdef`` written by fit ``fit_id`` at global step ``step``."""
    import torch

    from spark_torch_est.checkpoints.checkpoint import Checkpoint
    from spark_torch_est.core import rng
    from spark_torch_est.core.progress import Progress
    from tests.helpers import features_schema

    return Checkpoint.build(
        run_id="0123456789abcdef", fit_id=fit_id, progress=Progress(epoch=step // 10, global_step=step), history=[],
        partial_loss=(0.0, 0.0), epoch_rows=10, world_size=2, data_source="spark", seed=0, optimizer_made=[],
        output_shape=[1], label_kind="float", input_schema=features_schema(8).to_dict(), input_rows=[[8]],
        model={"w": torch.zeros(1)}, optimizer={"state": {}, "param_groups": []}, scheduler=None,
        rng=[rng.capture(torch.device("cpu"))], hooks={}).to_bytes()


def test_a_relaunch_resumes_only_from_a_checkpoint_this_fit_wrote(tmp_path):
    from spark_torch_est.checkpoints.checkpoint import Checkpoint
    from spark_torch_est.checkpoints.storage import CheckpointDir
    from spark_torch_est.cluster.launcher import Launcher
    from spark_torch_est.core.progress import Progress, Target
    from tests.helpers import task_spec

    spec = task_spec(Target(epoch=9), fit_id="this", checkpoint_dir=str(tmp_path), resume=checkpoint("earlier", 20))
    directory = CheckpointDir(str(tmp_path), run_id="0123456789abcdef")
    directory.write(checkpoint("another", 80), epoch=8, global_step=80)  # another fit's future of the run
    launcher = Launcher(None, None, max_retries=1, slot_wait_s=1)
    assert launcher._relaunch_spec(spec, Progress(epoch=2, global_step=20))[0].resume == spec.resume
    directory.write(checkpoint("this", 30), epoch=3, global_step=30)  # this fit's own
    relaunched, start = launcher._relaunch_spec(spec, Progress(epoch=2, global_step=20))
    assert start.global_step == 30 and Checkpoint.from_bytes(relaunched.resume).fit_id == "this"
    directory.write(b"not a checkpoint", epoch=4, global_step=40)  # a newer file that is none: passed over
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
    from spark_torch_est.cluster.control import GrowWatch, Launches, ScalingPolicy
    from spark_torch_est.core.progress import Interval, Target
    from tests.helpers import task_spec

    directory = CheckpointDir(str(tmp_path), run_id="0123456789abcdef")
    directory.write(b"step 10", epoch=0, global_step=10)
    watch = GrowWatch(2, directory)
    assert watch.ready(1) is None                                    # still shrunk
    directory.write(b"step 20", epoch=0, global_step=20)
    assert watch.ready(1) is None                                    # a checkpoint, but no slots for 2 ranks
    assert watch.ready(2) is None and watch.ready(2) is None         # back: the run trains on to its next checkpoint
    directory.write(b"step 30", epoch=0, global_step=30)
    assert "global step 30" in watch.ready(2)

    again = GrowWatch(2, directory)
    assert again.ready(2) is None                                    # back at step 30 ...
    directory.write(b"step 40", epoch=0, global_step=40)
    assert again.ready(1) is None                                    # ... gone before the checkpoint of step 40
    assert again.ready(2) is None                                    # back again, now after step 40
    directory.write(b"step 50", epoch=0, global_step=50)
    assert "global step 50" in again.ready(2)

    shrunk = task_spec(Target(epoch=9), world_size=1, checkpoint_dir=str(tmp_path), checkpoint_every=Interval(10, "ba"))
    scaling = ScalingPolicy(None, 2, 1, slot_wait_s=60, launches=Launches(max_retries=0))
    assert isinstance(scaling.grow_watch(shrunk), GrowWatch)
    assert ScalingPolicy(None, 1, 1, 60, Launches(0)).grow_watch(shrunk) is None  # not shrunk
    assert scaling.grow_watch(task_spec(Target(epoch=9), world_size=1, checkpoint_dir=str(tmp_path))) is None
    scaling.grown_at = time.monotonic()                              # it grew back just now
    assert scaling.grow_watch(shrunk) is None
    scaling.grown_at = time.monotonic() - 61
    assert isinstance(scaling.grow_watch(shrunk), GrowWatch)


class _Rows:
    """The rows a scripted launcher's jobs read: what the controller asks of KeptIngest."""

    frame = None

    def __init__(self) -> None:
        self.calls: list[str] = []

    def spec(self, spec):
        return spec

    def missing(self, error) -> bool:
        return "kept rows" in str(error)

    def read_again(self) -> None:
        self.calls.append("read_again")

    def relaunching(self) -> None:
        self.calls.append("relaunching")

    def succeeded(self, job) -> None:
        self.calls.append("succeeded")


def _scripted(outcomes, max_retries: int, **params):
    """A Launcher whose jobs end as ``outcomes`` say, in order (the real job cannot lose an
    executor in a unit test; the controller, the policies and their bounds are the real ones)."""
    from spark_torch_est.cluster.launcher import Launcher

    class Scripted(Launcher):
        def __init__(self) -> None:
            super().__init__(None, _Rows(), max_retries=max_retries, slot_wait_s=1, **params)
            self.jobs: list[int] = []
            self.script = iter(outcomes)

        def _job(self, job, launch, frame, grow):
            self.jobs.append(job.world_size)
            outcome = next(self.script)
            return outcome(self) if callable(outcome) else outcome

    return Scripted()


def test_a_loop_of_lost_executors_ends_within_max_retries_and_the_bound_saying_what_happened(tmp_path, caplog):
    import itertools
    import logging

    import pytest

    from spark_torch_est.checkpoints.storage import CheckpointDir
    from spark_torch_est.cluster.control import MAX_UNCOUNTED_RELAUNCHES, Failed, SlotsLost
    from spark_torch_est.core.progress import Progress, Target
    from spark_torch_est.errors import TrainingFailedError
    from tests.helpers import task_spec

    def crash_after_a_checkpoint(launcher):  # the first job wrote its periodic checkpoint, then a peer died
        CheckpointDir(str(tmp_path), run_id="0123456789abcdef").write(checkpoint("this", 10), epoch=1, global_step=10)
        return Failed(TrainingFailedError("peer died", retryable=True))

    launcher = _scripted(itertools.chain([crash_after_a_checkpoint], itertools.repeat(SlotsLost(1, 2))),
                         max_retries=1)
    spec = task_spec(Target(epoch=2), world_size=2, checkpoint_dir=str(tmp_path), fit_id="this")
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"), \
            pytest.raises(TrainingFailedError) as raised:
        launcher.run(spec, Progress())
    assert len(launcher.jobs) == 1 + 1 + MAX_UNCOUNTED_RELAUNCHES  # maxRetries=1, then the bound
    text = str(raised.value)
    assert f"launched its training job {len(launcher.jobs)} times (1 relaunches counted in maxRetries, " \
           f"{MAX_UNCOUNTED_RELAUNCHES} not)" in text
    assert "job 1: failed: peer died; job 2: the cluster's task slots fell to 1 while the job needed 2" in text
    assert "the newest at epoch 1, global step 10: continue from it with est.fit(df, resume_from=" in text
    assert raised.value.retryable
    relaunched = [r.getMessage() for r in caplog.records if r.getMessage().startswith("relaunching training")]
    assert len(relaunched) == len(launcher.jobs) - 1 and "after an executor was lost" in relaunched[-1]


def test_the_controller_applies_each_decision_and_a_user_error_is_never_retried():
    """Kept rows gone: the same job reads through Spark; the store unreachable: the next job
    rendezvouses without it; a lost executor: relaunched from the newest checkpoint; a user
    error: raised at once although retries are left."""
    import pytest

    from spark_torch_est.cluster.control import Failed, Finished, RowsMissing, SlotsLost, StoreUnreachable
    from spark_torch_est.cluster.failure import StoreUnreachableError
    from spark_torch_est.core.progress import Progress, Target
    from spark_torch_est.errors import InvalidInputError, TrainingFailedError
    from tests.helpers import task_spec

    spec = task_spec(Target(epoch=2), world_size=2)
    launcher = _scripted([RowsMissing(InvalidInputError("the kept rows of this DataFrame are gone")),
                          StoreUnreachable(StoreUnreachableError("no route", retryable=True)),
                          SlotsLost(1, 2), Finished(b"done")], max_retries=0)
    assert launcher.run(spec, Progress()) == b"done"
    assert launcher.rows.calls == ["read_again", "relaunching", "succeeded"]
    assert launcher._store_unreachable  # the driver's host: rerouted for the rest of this fit

    user = TrainingFailedError("ValueError: the loss raised")
    launcher = _scripted([Failed(user), Finished(b"never")], max_retries=3)
    with pytest.raises(TrainingFailedError) as raised:
        launcher.run(spec, Progress())
    assert raised.value is user and len(launcher.jobs) == 1


def test_a_shrunk_run_grows_back_through_the_scaling_policy_within_the_bound():
    from spark_torch_est.cluster.control import MAX_UNCOUNTED_RELAUNCHES, Finished, GrowBack
    from spark_torch_est.core.progress import Progress, Target
    from tests.helpers import task_spec

    grow = GrowBack(1, "2 task slots are free again and the run wrote its checkpoint at global step 30")
    launcher = _scripted([grow, Finished(b"grown")], max_retries=0)
    assert launcher.run(task_spec(Target(epoch=2), world_size=2), Progress()) == b"grown"
    assert launcher.rows.calls == ["relaunching", "succeeded"] and len(launcher.jobs) == 2
    assert MAX_UNCOUNTED_RELAUNCHES >= 2  # a lost executor and its grow-back fit in the bound several times


def test_lost_executors_between_checkpoints_do_not_use_up_the_bound_a_run_without_progress_has(tmp_path):
    """The bound on uncounted relaunches counts those in a row without progress: a long
    elastic run that loses an executor after each of its checkpoints keeps training."""
    from spark_torch_est.checkpoints.storage import CheckpointDir
    from spark_torch_est.cluster.control import MAX_UNCOUNTED_RELAUNCHES, Finished, SlotsLost
    from spark_torch_est.core.progress import Progress, Target
    from tests.helpers import task_spec

    losses = MAX_UNCOUNTED_RELAUNCHES + 3
    directory = CheckpointDir(str(tmp_path), run_id="0123456789abcdef")

    def lost_after_a_checkpoint(step):
        def job(launcher):
            directory.write(checkpoint("this", step), epoch=step, global_step=step)
            return SlotsLost(1, 2)
        return job

    launcher = _scripted([lost_after_a_checkpoint(step) for step in range(1, losses + 1)] + [Finished(b"done")],
                         max_retries=0)
    spec = task_spec(Target(epoch=losses + 5), world_size=2, checkpoint_dir=str(tmp_path), fit_id="this")
    assert launcher.run(spec, Progress()) == b"done"
    assert len(launcher.jobs) == losses + 1


def test_a_job_that_wrote_a_checkpoint_after_the_bound_was_used_up_is_relaunched_from_it(tmp_path):
    """The bound's relaunches used up without progress, then a job trains, writes a checkpoint
    and loses an executor: that is progress, so the run goes on from the checkpoint instead of
    failing on the bound."""
    from spark_torch_est.checkpoints.storage import CheckpointDir
    from spark_torch_est.cluster.control import MAX_UNCOUNTED_RELAUNCHES, Finished, SlotsLost
    from spark_torch_est.core.progress import Progress, Target
    from tests.helpers import task_spec

    directory = CheckpointDir(str(tmp_path), run_id="0123456789abcdef")

    def trained_then_lost(launcher):
        directory.write(checkpoint("this", 30), epoch=3, global_step=30)
        return SlotsLost(1, 2)

    jobs = [SlotsLost(1, 2)] * MAX_UNCOUNTED_RELAUNCHES + [trained_then_lost, Finished(b"done")]
    launcher = _scripted(jobs, max_retries=0)
    spec = task_spec(Target(epoch=9), world_size=2, checkpoint_dir=str(tmp_path), fit_id="this")
    assert launcher.run(spec, Progress()) == b"done"
    assert len(launcher.jobs) == MAX_UNCOUNTED_RELAUNCHES + 2
