"""How a failed barrier job's error text becomes the user's error."""

from spark_torch_est.errors import InvalidInputError, TrainingFailedError
from spark_torch_est.failure import SYSTEM, USER, Failure
from spark_torch_est.launcher import explain_job_failure

CRASH = ("org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a failed "
         "barrier ResultStage. Most recent failure reason: Stage failed because barrier task ResultTask(1, 1) "
         "finished unsuccessfully.\norg.apache.spark.SparkException: Python worker exited unexpectedly (crashed)")


def test_a_crashed_worker_is_retryable():
    error = explain_job_failure(CRASH, [])
    assert isinstance(error, TrainingFailedError) and error.retryable
    assert "Python worker exited unexpectedly" in error.message


def test_a_user_error_on_one_rank_beats_the_peer_that_lost_its_connection():
    peer = Failure(SYSTEM, "RuntimeError: Connection closed by peer", 0, "backward")
    user = Failure(USER, "ValueError: bad", 1, "after_train_iter", hook="h")
    error = explain_job_failure(CRASH, [peer, user])
    assert (error.rank, error.hook, error.retryable) == (1, "h", False)


def test_result_size_missing_modules_and_unsupported_barrier_jobs():
    too_large = explain_job_failure("Total size of serialized results of 1 tasks (50.0 MiB) is bigger than "
                                    "spark.driver.maxResultSize (1024.0 KiB)", [])
    assert "spark.driver.maxResultSize (1024.0 KiB)" in too_large.message and not too_large.retryable
    missing = explain_job_failure("ModuleNotFoundError: No module named 'torch'", [])
    assert "'torch'" in missing.message and "PYSPARK_PYTHON" in missing.message and not missing.retryable
    unsupported = explain_job_failure("[SPARK-24942]: Barrier execution mode does not support dynamic resource "
                                      "allocation for now.", [])
    assert isinstance(unsupported, InvalidInputError) and "dynamic resource allocation" in str(unsupported)
