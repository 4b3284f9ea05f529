"""The driver's side of a job's failures: what it reads from its rendezvous store."""

import torch.distributed as dist

from spark_torch_est.failure import USER, Failure
from spark_torch_est.launcher import _DriverStore
from spark_torch_est.protocol import failure_key
from spark_torch_est.spec import Launch
from spark_torch_est.worker import _report

LAUNCH = Launch(job_id="ste-abc", secret=b"j" * 32)


def test_the_driver_reads_only_reports_sealed_with_the_jobs_secret():
    driver = _DriverStore("127.0.0.1", timeout_s=10)
    try:
        client = dist.TCPStore("127.0.0.1", driver.port, is_master=False)
        rank_store = dist.PrefixStore(LAUNCH.job_id, client)
        genuine = Failure(USER, "ValueError: x", 1, "after_train_iter", hook="h")
        _report(rank_store, genuine, LAUNCH.secret)
        forged = Failure(USER, "attacker's text", 0, "setup")
        rank_store.set(failure_key(0), forged.seal(b"not the secret"))          # an outsider's report
        client.set(f"{LAUNCH.job_id}/{failure_key(2)}", '{"kind": "user", "rank": 2, "bogus": 1}')
        assert driver.failures(LAUNCH, 3) == [genuine]
    finally:
        driver.close()


def test_a_relaunch_resumes_only_from_a_checkpoint_this_fit_wrote(tmp_path):
    import torch

    from spark_torch_est.checkpoint import Checkpoint
    from spark_torch_est.launcher import Launcher
    from spark_torch_est.progress import Progress, Target
    from spark_torch_est import rng
    from spark_torch_est.storage import CheckpointDir
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
    from spark_torch_est.launcher import Launcher

    rerouted = Launcher(None, None, max_retries=1, slot_wait_s=1)
    rerouted._store_unreachable.add("127.0.0.1")
    assert Launcher(None, None, max_retries=1, slot_wait_s=1)._store_unreachable == set()
