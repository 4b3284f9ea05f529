"""Failures: classified by cause on the rank, sealed on the way and explained on the driver (the policy
that decides on them: test_control.py)."""

import json
import logging

import pytest
import torch.distributed as dist

from spark_torch_est.cluster.failure import (
    _BEGIN,
    _END,
    CHECKPOINT,
    INPUT,
    SYSTEM,
    USER,
    Failure,
    PeerAuthenticationError,
    _tag,
    describe,
    explain_job_failure,
    is_spark_error,
    package_bug,
)
from spark_torch_est.errors import IncompatibleCheckpointError, InputDataError, InvalidInputError, TrainingFailedError

SECRET = b"k" * 32
CRASH = ("org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a failed "
         "barrier ResultStage. Most recent failure reason: Stage failed because barrier task ResultTask(1, 1) "
         "finished unsuccessfully.\norg.apache.spark.SparkException: Python worker exited unexpectedly (crashed)")


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:  # noqa: B036 - a real traceback for describe()
        return caught


@pytest.mark.parametrize("error, stage, hook, kind", [
    # a dead peer is a system failure in any stage, e.g. DDP's buffer broadcast in forward
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5"),
     "forward", None, SYSTEM),
    (RuntimeError("Connection reset by peer"), "after_train_iter", "h", SYSTEM),
    (dist.DistNetworkError("store gone"), "setup", None, SYSTEM),
    (PeerAuthenticationError("impostor"), "rendezvous", None, SYSTEM),
    # no user code runs at the rendezvous: a gloo address poisoned in the store is the network's failure
    (RuntimeError("[enforce fail at gloo/transport/tcp/device.cc:83] ifa != nullptr. Unable to find address"),
     "rendezvous", None, SYSTEM),
    (KeyboardInterrupt(), "forward", None, SYSTEM),
    # deterministic errors in user code are not retried, whatever the stage
    (RuntimeError("grad can be implicitly created only for scalar outputs"), "backward", None, USER),
    (TypeError("the loss must be a tensor holding one value"), "loss", None, USER),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "forward", None, USER),
    (ValueError("bad"), "collective", None, USER),
    (InputDataError("nulls"), "ingest", None, INPUT),
    (IncompatibleCheckpointError("shapes"), "setup", None, CHECKPOINT),
])
def test_failures_are_classified_by_cause_not_stage(error, stage, hook, kind):
    assert describe(_raised(error), 0, stage, hook).kind == kind


def test_a_sealed_report_survives_wrapping_and_maps_to_the_right_error():
    failure = describe(_raised(ValueError("boom")), 1, "after_train_iter", "bad")
    wrapped = f"py4j.Py4JJavaError: An error occurred\n  {failure.seal(SECRET)}\n\tat org.apache..."
    assert Failure.unseal(wrapped, SECRET) == failure
    error = Failure.unseal(wrapped, SECRET).to_error()
    assert isinstance(error, TrainingFailedError)
    assert (error.rank, error.stage, error.hook, error.retryable) == (1, "after_train_iter", "bad", False)
    assert "Traceback" in str(error)
    assert isinstance(Failure(INPUT, "x", 0, "ingest").to_error(), InputDataError)
    assert Failure(SYSTEM, "x", 0, "collective").to_error().retryable


def test_a_forged_report_is_ignored(caplog):
    forged = Failure(USER, "attacker's text", 1, "after_train_iter")
    with caplog.at_level(logging.WARNING):
        assert Failure.unseal(forged.seal(b"guessed" * 5), SECRET) is None
    assert "does not carry this job's secret" in caplog.text


def _sealed_body(body) -> str:
    text = json.dumps(body)
    return f"{_BEGIN}{_tag(SECRET, text)} {text}{_END}"


def test_an_extra_field_is_dropped():
    body = {"kind": USER, "message": "m", "rank": 0, "stage": "s", "unexpected": 1}
    assert Failure.unseal(_sealed_body(body), SECRET) == Failure(USER, "m", 0, "s")


@pytest.mark.parametrize("body", [
    [1, 2], {"kind": "root", "message": "m", "rank": 0, "stage": "s"}, {"kind": USER, "message": 5, "rank": 0,
                                                                      "stage": "s"},
    {"kind": USER, "message": "m", "rank": -1, "stage": "s"}, {"kind": USER, "message": "m", "rank": True,
                                                               "stage": "s"},
])
def test_a_malformed_report_with_a_valid_seal_is_ignored_not_raised(body):
    assert Failure.unseal(_sealed_body(body), SECRET) is None


def test_a_crashed_worker_is_retryable():
    error = explain_job_failure(CRASH, [], SECRET)
    assert isinstance(error, TrainingFailedError) and error.retryable
    assert "Python worker exited unexpectedly" in error.message


def test_a_user_error_on_one_rank_beats_the_peer_that_lost_its_connection():
    peer = Failure(SYSTEM, "RuntimeError: Connection closed by peer", 0, "backward")
    user = Failure(USER, "ValueError: bad", 1, "after_train_iter", hook="h")
    error = explain_job_failure(CRASH, [peer, user], SECRET)
    assert (error.rank, error.hook, error.retryable) == (1, "h", False)


def test_an_impostor_is_named_before_the_rank_it_displaced():
    displaced = Failure(SYSTEM, "RuntimeError: [gloo] connectFullMesh failed", 0, "rendezvous")
    proof = Failure(SYSTEM, "PeerAuthenticationError: rank(s) [0] could not prove they hold this job's secret", 1,
                    "rendezvous")
    error = explain_job_failure(CRASH, [displaced, proof], SECRET)
    assert "could not prove they hold this job's secret" in error.message and error.retryable


def test_result_size_missing_modules_and_unsupported_barrier_jobs():
    too_large = explain_job_failure("Total size of serialized results of 1 tasks (50.0 MiB) is bigger than "
                                    "spark.driver.maxResultSize (1024.0 KiB)", [], SECRET)
    assert "spark.driver.maxResultSize (1024.0 KiB)" in too_large.message and not too_large.retryable
    missing = explain_job_failure("ModuleNotFoundError: No module named 'torch'", [], SECRET)
    assert "'torch'" in missing.message and "PYSPARK_PYTHON" in missing.message and not missing.retryable
    no_daemon = explain_job_failure(
        "org.apache.spark.SparkException: \nError from python worker:\n  /env/bin/python: No module named "
        "spark_torch_est.daemonx\nPYTHONPATH was:\n  /spark/python/lib/pyspark.zip\norg.apache.spark.SparkException: "
        "EOFException occurred while reading the port number from spark_torch_est.daemonx's stdout.", [], SECRET)
    assert "'spark_torch_est.daemonx'" in no_daemon.message and not no_daemon.retryable
    assert "spark.python.daemon.module=spark_torch_est.daemonx" in no_daemon.message
    unsupported = explain_job_failure(
        "org.apache.spark.SparkException: [SPARK-24820][SPARK-24821]: Barrier execution mode does not allow the "
        "following pattern of RDD chain within a barrier stage:\n1. Ancestor RDDs that have different number of "
        "partitions from the resulting RDD (e.g. union()/coalesce()/first()/take()/PartitionPruningRDD).\n"
        "2. An RDD that depends on multiple barrier RDDs (e.g. barrierRdd1.zip(barrierRdd2)).\n"
        "\tat org.apache.spark.scheduler.DAGScheduler.check(DAGScheduler.scala:1)", [], SECRET)
    assert isinstance(unsupported, InvalidInputError)
    assert "union()/coalesce()" in str(unsupported) and "barrierRdd1.zip" in str(unsupported)
    assert "DAGScheduler.scala" not in str(unsupported)


def test_a_report_whose_text_holds_the_end_marker_still_unseals():
    failure = Failure(USER, f"ValueError: the data said {_END} and more", 0, "loss")
    assert Failure.unseal("x " + failure.seal(SECRET) + " y", SECRET) == failure


def test_a_huge_forged_store_value_is_read_in_linear_time():
    import time

    forged = (_BEGIN + "0" * 64 + " {") * 40_000  # 1.5 MB of begin markers, no end
    started = time.monotonic()
    assert Failure.unseal(forged + _END, SECRET) is None
    assert time.monotonic() - started < 1.0


def test_a_file_spark_cannot_read_beats_the_broken_stream_its_rank_reported():
    text = ("org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file "
            "file:///t/part-0.parquet.  SQLSTATE: KD001\nCaused by: java.io.IOException: not a Parquet file")
    broken = Failure(SYSTEM, "ArrowInvalid: Tried reading schema message, was null or length 0", 1, "ingest")
    error = explain_job_failure(text, [broken], SECRET)
    assert isinstance(error, InputDataError) and "part-0.parquet" in str(error) and "not a Parquet file" in str(error)


def _raised_by(call) -> BaseException:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error itself is what is examined
        return error
    raise AssertionError("did not raise")


def test_an_attribute_error_of_the_packages_own_code_says_it_is_a_bug_and_is_not_retried():
    from spark_torch_est.core import support

    ours = describe(_raised_by(lambda: support.require(None)), rank=0, stage="setup", hook=None)  # None.package
    assert ours.kind == USER and not ours.to_error().retryable
    assert "a bug in spark_torch_est" in ours.message and "spark_torch_est/core/support.py:" in ours.message
    theirs = describe(_raised_by(lambda: None.weight), rank=0, stage="forward", hook=None)  # the user's code
    assert theirs.kind == USER and "a bug" not in theirs.message


def test_only_sparks_own_errors_are_read_as_failed_jobs_on_the_driver():
    from py4j.protocol import Py4JNetworkError
    from pyspark.errors import PySparkAttributeError, PySparkRuntimeError

    assert is_spark_error(Py4JNetworkError("the JVM went away"))
    # positional: PySpark 4 calls them errorClass and messageParameters, 3.5 error_class and message_parameters
    assert is_spark_error(PySparkRuntimeError(None, "NOT_IMPLEMENTED", {"feature": "x"}))
    assert not is_spark_error(AttributeError("'DataFrame' object has no attribute 'toArrow'"))
    assert not is_spark_error(PySparkAttributeError(None, "ATTRIBUTE_NOT_SUPPORTED", {"attr_name": "toArrow"}))
    bug = package_bug(AttributeError("'DataFrame' object has no attribute 'toArrow'"))
    assert not bug.retryable and "toArrow" in bug.message and "please report it" in bug.message


#: A user-defined function's error in a failed job's text, as PySpark 4 and 3.5 give it: the
#: captured exception of a plain job, and the Py4J error of a barrier job.
_UDF_TRACEBACK = ('Traceback (most recent call last):\n  File "/home/me/job.py", line 6, in bad\n'
                  '    if x > 900: raise ValueError("no")\n                ^^^^^^^^^^\nValueError: no\n')
UDF_FAILURES = {
    "4 captured": "An exception was thrown from the Python worker:\n" + _UDF_TRACEBACK,
    "4 barrier": ("An error occurred while calling o113.getResult.\n: org.apache.spark.SparkException: Exception "
                  "thrown in awaitResult: \nCaused by: org.apache.spark.SparkException: Job aborted due to stage "
                  "failure: Could not recover from a failed barrier ResultStage.\norg.apache.spark.api.python."
                  "PythonException: [PYTHON_EXCEPTION] An exception was thrown from the Python worker: "
                  + _UDF_TRACEBACK + " SQLSTATE: 38000\n\tat org.apache.spark.api.python.BasePythonRunner.x(a:1)"),
    "3.5 captured": ("\n  An exception was thrown from the Python worker. Please see the stack trace below.\n"
                     + _UDF_TRACEBACK),
    "3.5 barrier": ("An error occurred while calling o108.getResult.\n: org.apache.spark.SparkException: Job aborted "
                    "due to stage failure: Task 1 in stage 1.0 failed 1 times, most recent failure: Lost task 1.0\n"
                    "org.apache.spark.api.python.PythonException: " + _UDF_TRACEBACK + "\n\tat org.apache.x(a:1)"),
}


@pytest.mark.parametrize("spark_text", UDF_FAILURES.values(), ids=UDF_FAILURES.keys())
def test_the_dataframes_own_python_error_is_named_and_not_retried_over_the_ranks_lost_input(spark_text):
    lost = Failure(SYSTEM, "SparkInputLost: Spark stopped sending this task's rows", 1, "ingest")
    for reported in ([], [lost]):
        error = explain_job_failure(spark_text, reported, SECRET)
        assert isinstance(error, TrainingFailedError) and not error.retryable, spark_text
        assert error.message.startswith("the training DataFrame's own code failed")
        assert "ValueError: no" in error.message
        assert 'File "/home/me/job.py", line 6, in bad' in str(error)  # the user's frame, below the message


def test_a_rank_error_of_the_users_code_still_beats_the_dataframes():
    user = Failure(USER, "ValueError: bad", 1, "after_train_iter", hook="h")
    error = explain_job_failure(UDF_FAILURES["4 barrier"], [user], SECRET)
    assert (error.rank, error.hook, error.retryable) == (1, "h", False) and error.message.endswith("ValueError: bad")


def test_a_python_error_through_the_packages_own_code_is_not_the_dataframes():
    ours = UDF_FAILURES["4 captured"].replace(
        'Traceback (most recent call last):\n',
        'Traceback (most recent call last):\n'
        '  File "/x/site-packages/spark_torch_est/ingest/staged.py", line 90, in w\n    writer.write_batch(rows)\n')
    error = explain_job_failure(ours, [], SECRET)
    assert error.retryable and error.message.startswith("the training job failed")


#: A TorchModel's transform in the training DataFrame, its model raising (PySpark 4's simplified traceback).
_TRANSFORM_FRAMES = (
    '  File "/x/site-packages/spark_torch_est/scoring/inference.py", line 192, in task\n'
    '  File "/x/site-packages/spark_torch_est/scoring/inference.py", line 173, in _forward\n'
    '  File "/x/site-packages/spark_torch_est/core/schema.py", line 143, in call_model\n'
    '    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)\n')


@pytest.mark.parametrize("below", [
    '  File "/x/site-packages/torch/nn/modules/module.py", line 1789, in _call_impl\n'
    '  File "/home/me/model.py", line 12, in forward\n',
    "",
], ids=["the model's own code", "this package's transform code"])
def test_a_torch_models_transform_in_the_dataframe_failing_is_the_dataframes_error(below):
    users = _UDF_TRACEBACK.split("\n", 1)[1].rsplit("ValueError: no", 1)[0]  # the user's frame
    text = UDF_FAILURES["4 barrier"].replace(users, _TRANSFORM_FRAMES + below)
    assert text != UDF_FAILURES["4 barrier"]
    lost = Failure(SYSTEM, "SparkInputLost: Spark stopped sending this task's rows", 1, "ingest")
    error = explain_job_failure(text, [lost], SECRET)
    assert not error.retryable and "ValueError: no" in error.message, error.message
    assert error.message.startswith("the training DataFrame's own code failed while Spark computed its rows (a "
                                    "TorchModel's transform in it)")
    entered_by_a_rank = text.replace("Traceback (most recent call last):\n", "Traceback (most recent call last):\n"
                                     '  File "/x/site-packages/spark_torch_est/cluster/worker.py", line 3, in task\n')
    assert explain_job_failure(entered_by_a_rank, [], SECRET).retryable  # the package's scoring code, called by a rank


@pytest.mark.parametrize("spark_text", [
    "org.apache.spark.SparkNumberFormatException: [CAST_INVALID_INPUT] The value 'abc' of the type \"STRING\" cannot "
    "be cast to \"INT\" because it is malformed. SQLSTATE: 22018\n== DataFrame ==\n\"cast\" was called from",
    "Caused by: org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in stage 0.0 failed 1 times: "
    "org.apache.spark.SparkNumberFormatException: [CAST_INVALID_INPUT] The value 'abc' of the type \"STRING\" cannot "
    "be cast to \"INT\" because it is malformed. If necessary set \"spark.sql.ansi.enabled\" to \"false\"\n",
], ids=["4", "3.5"])
def test_a_data_error_of_spark_computing_the_rows_is_named_and_not_retried(spark_text):
    error = explain_job_failure(spark_text, [], SECRET)
    assert not error.retryable and "[CAST_INVALID_INPUT] The value 'abc'" in error.message
    assert error.message.startswith("Spark failed to compute the training DataFrame's rows")


@pytest.mark.parametrize("frames", [
    '  File "/x/pyspark/worker.py", line 1, in main\n  File "<frozen importlib._bootstrap>", line 2, in _find\n',
    '  File "/tmp/spark-1/userFiles-2/deps.zip/spark_torch_est/cluster/worker.py", line 3, in task\n',
], ids=["PySpark's worker loading the job's function", "this package, shipped in a zip"])
def test_a_traceback_without_the_users_code_or_through_this_package_is_not_the_dataframes(frames):
    text = ("org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n" + frames
            + "ModuleNotFoundError: No module named 'spark_torch_est'\n")
    error = explain_job_failure(text, [], SECRET)
    assert "own code failed" not in error.message
    if "pyspark/worker.py" in frames:  # the advice for executors without the package
        assert "the executors' Python cannot import 'spark_torch_est'" in error.message


def test_a_cut_off_traceback_leaves_the_ranks_report_in_charge():
    cut = UDF_FAILURES["4 barrier"].split("ValueError: no")[0].rsplit("\n", 3)[0]  # ends inside the frames
    lost = Failure(SYSTEM, "RuntimeError: NCCL error: unhandled system error", 0, "forward")
    error = explain_job_failure(cut, [lost], SECRET)
    assert error.retryable and "NCCL" in error.message


def test_a_chained_error_names_the_last_exception_and_a_notebook_cell_is_the_users_code():
    text = ("An exception was thrown from the Python worker:\nTraceback (most recent call last):\n"
            '  File "<command-4242>", line 3, in parse\n    return int(x)\nValueError: invalid literal\n\n'
            "During handling of the above exception, another exception occurred:\n\n"
            'Traceback (most recent call last):\n  File "<command-4242>", line 5, in parse\n'
            "    raise BadRow(x)\nBadRow: row 17 is not a number\n")
    error = explain_job_failure(text, [], SECRET)
    assert not error.retryable and "BadRow: row 17 is not a number" in error.message


def test_a_huge_hostile_error_text_is_read_in_linear_time():
    import time

    hostile = ("PythonException " * 60_000 + "[A]" * 100_000 + "[FAILED_READ_FILE]" * 50_000
               + "bigger than spark.driver.maxResultSize (" * 20_000 + "  File \"/" + "spark_torch_est/" * 20_000
               + "Traceback (most recent call last):\n  File \"" + "x" * 100_000 + " " * 100_000 + "SQLSTATE: 22")
    started = time.monotonic()
    explain_job_failure(hostile, [], SECRET)
    assert time.monotonic() - started < 1.0
