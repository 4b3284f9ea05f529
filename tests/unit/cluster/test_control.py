"""The failure policy: which job outcomes are relaunched, rerouted, read again or raised, and
the one bound on the relaunches maxRetries does not count."""

import logging

from spark_torch_est.cluster.failure import StoreUnreachableError
from spark_torch_est.errors import IncompatibleCheckpointError, InvalidInputError, TrainingFailedError


def test_the_policy_relaunches_system_failures_while_retries_last_and_logs_why(caplog):
    from spark_torch_est.cluster.control import Action, Failed, FailurePolicy, Launches, StoreUnreachable

    policy = FailurePolicy(Launches(max_retries=1))
    system = TrainingFailedError("peer died", retryable=True)
    with caplog.at_level(logging.INFO, logger="spark_torch_est"):
        assert policy.decide(Failed(system)).action is Action.RELAUNCH
        raised = policy.decide(Failed(system))
        assert raised.action is Action.RAISE and raised.error is system
        user = TrainingFailedError("hook raised")
        assert policy.decide(Failed(user)).error is user
        unreachable = StoreUnreachable(StoreUnreachableError("no route", retryable=True))
        assert policy.decide(unreachable).action is Action.REROUTE
    messages = [r.getMessage() for r in caplog.records]
    assert any("relaunching training (1 of 1) after a system failure: peer died" in m for m in messages)
    assert any("maxRetries=1 relaunches used" in m for m in messages)
    assert any("not one a relaunch can fix" in m for m in messages)


def test_a_user_error_is_never_relaunched_whatever_the_retries_left():
    from spark_torch_est.cluster.control import Action, Failed, FailurePolicy, Launches

    launches = Launches(max_retries=5)
    policy = FailurePolicy(launches)
    for error in (TrainingFailedError("ValueError: in the loss"), InvalidInputError("bad column"),
                  IncompatibleCheckpointError("other model")):
        decision = policy.decide(Failed(error))
        assert decision.action is Action.RAISE and decision.error is error
    assert launches.counted == launches.uncounted == 0


def test_lost_executors_grow_backs_rows_missing_and_reroutes_draw_on_one_bound_beside_max_retries(caplog):
    """A loop of lost executors ends: every relaunch maxRetries does not count is counted
    against MAX_UNCOUNTED_RELAUNCHES, and the error says how many launches and why each."""
    from spark_torch_est.cluster.control import (
        MAX_UNCOUNTED_RELAUNCHES,
        Action,
        Failed,
        FailurePolicy,
        Launches,
        RowsMissing,
        SlotsLost,
    )

    launches = Launches(max_retries=1)
    policy = FailurePolicy(launches)
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        launches.end(Failed(TrainingFailedError("peer died", retryable=True)))
        assert policy.decide(launches.ended[-1]).counted
        gone = RowsMissing(InvalidInputError("the kept rows of this DataFrame are gone (part 1)"))
        launches.end(gone)
        assert policy.decide(gone).action is Action.REREAD
        decisions = []
        for _ in range(MAX_UNCOUNTED_RELAUNCHES):
            launches.end(SlotsLost(1, 2))
            decisions.append(policy.decide(launches.ended[-1]))
    assert [d.action for d in decisions] == [Action.RELAUNCH] * (MAX_UNCOUNTED_RELAUNCHES - 1) + [Action.RAISE]
    error = decisions[-1].error
    assert isinstance(error, TrainingFailedError)
    text = str(error)
    assert f"the {MAX_UNCOUNTED_RELAUNCHES} relaunches a fit makes beyond maxRetries" in text
    assert f"launched its training job {MAX_UNCOUNTED_RELAUNCHES + 2} times (1 relaunches counted in maxRetries" in text
    assert "job 1: failed: peer died; job 2: the kept rows of this DataFrame are gone" in text
    assert "job 3: the cluster's task slots fell to 1 while the job needed 2" in text
    assert sum("not counted in maxRetries" in r.getMessage() for r in caplog.records) == MAX_UNCOUNTED_RELAUNCHES
