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
