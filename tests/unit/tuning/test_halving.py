"""The rungs of successive halving, decided without Spark: what trains, what is kept."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from spark_torch_est.tuning.halving import SuccessiveHalving, _Trial


class FakeRun:
    """Stands in for a TorchEstimator copy: progress and maxEpochs only."""

    def __init__(self, max_epochs: int) -> None:
        self.progress = SimpleNamespace(epoch=0)
        self.max_epochs = max_epochs

    def getMaxEpochs(self) -> int:
        return self.max_epochs


def _run(max_epochs: list[int], metric, eta: int = 2, min_epochs: int = 1, larger: bool = False, stop_at=None):
    """Runs the rungs with ``metric(index, epochs)``; returns the winner's index, the rungs
    and the epochs each map trained."""
    trials = [_Trial(i, FakeRun(m)) for i, m in enumerate(max_epochs)]
    trained = [0] * len(trials)

    def advance_all(work):
        for trial, epochs in work:
            reached = min(epochs, stop_at) if stop_at is not None else epochs
            trained[trial.index] += reached - trial.epochs
            trial.stalled = reached == trial.epochs
            trial.estimator.progress.epoch = reached
            trial.metric = metric(trial.index, trial.epochs)

    winner, rungs = SuccessiveHalving(eta=eta)._rungs(trials, min_epochs, larger, advance_all)
    return winner.index, rungs, trained


def test_four_maps_eta_two_train_eight_epochs_and_the_winner_reaches_max_epochs():
    winner, rungs, trained = _run([4] * 4, lambda i, e: [4.0, 3.0, 1.0, 2.0][i] / e)
    assert winner == 2 and trained == [1, 1, 4, 2] and sum(trained) == 8
    assert [(r["rung"], r["index"], r["epochs"], r["kept"]) for r in rungs] == [
        (0, 0, 1, False), (0, 1, 1, False), (0, 2, 1, True), (0, 3, 1, True),
        (1, 2, 2, True), (1, 3, 2, False), (2, 2, 4, True)]


def test_larger_is_better_nan_last_and_ties_to_the_earlier_map():
    values = [float("nan"), 5.0, 9.0, 9.0]
    winner, rungs, _ = _run([2] * 4, lambda i, e: values[i], larger=True)
    assert [r["kept"] for r in rungs if r["rung"] == 0] == [False, False, True, True]
    assert winner == 2  # a tie with map 3: the earlier map wins


def test_eta_three_keeps_a_third_and_multiplies_epochs_by_three():
    winner, rungs, trained = _run([9] * 5, lambda i, e: i / e, eta=3)
    assert [r["index"] for r in rungs if r["rung"] == 1] == [0, 1]  # ceil(5 / 3)
    assert [r["epochs"] for r in rungs if r["rung"] == 1] == [3, 3]
    assert winner == 0 and trained == [9, 3, 1, 1, 1]


def test_a_map_at_its_own_max_epochs_stays_with_its_last_metric():
    winner, rungs, trained = _run([1, 4, 4], lambda i, e: [0.5, 2.0, 3.0][i] / e)
    assert [(r["index"], r["epochs"]) for r in rungs if r["rung"] == 1] == [(0, 1), (1, 2)]
    assert trained == [1, 2, 1] and winner == 0  # at its cap, map 0 still beats map 1 at 2 epochs


def test_when_every_kept_map_is_at_its_cap_the_best_one_wins_without_more_training():
    winner, rungs, trained = _run([1, 1, 1, 1], lambda i, e: [3.0, 1.0, 2.0, 4.0][i])
    assert winner == 1 and trained == [1, 1, 1, 1] and [r["kept"] for r in rungs] == [False, True, False, False]


def test_a_run_that_stops_training_early_ends_the_search_instead_of_looping():
    winner, rungs, trained = _run([8, 8], lambda i, e: float(i), stop_at=2)
    assert winner == 0 and trained == [2, 1] and rungs[-1]["epochs"] == 2


@pytest.mark.parametrize("n, eta", [(1, 2), (7, 2), (8, 3), (16, 4)])
def test_every_rung_keeps_ceil_n_over_eta(n, eta):
    _, rungs, _ = _run([64] * n, lambda i, e: (i * 7919 % n) / e, eta=eta)
    sizes = [sum(r["rung"] == k for r in rungs) for k in range(max(r["rung"] for r in rungs) + 1)]
    for before, after in zip(sizes, sizes[1:]):
        assert after == math.ceil(before / eta) or (before == 1 and after == 1)
    assert sizes[-1] == 1


# ------------------------------------------------------------------ OptunaPruning and save


def test_an_estimator_holding_optuna_pruning_refuses_save_before_writing_and_copies_keep_the_live_trial(tmp_path):
    optuna = pytest.importorskip("optuna")
    from spark_torch_est.errors import InvalidInputError
    from spark_torch_est.tuning import OptunaPruning
    from tests.helpers import linear_estimator

    study = optuna.create_study()
    trial = study.ask()
    est = linear_estimator(loggers=[OptunaPruning(trial)])
    with pytest.raises(InvalidInputError) as error:
        est.save(str(tmp_path / "saved"))
    assert str(error.value).startswith(f"OptunaPruning (trial {trial.number}) cannot be saved with the estimator")
    assert "loaded.setLoggers([*loaded.loggers, OptunaPruning(trial)])" in str(error.value)
    assert not (tmp_path / "saved").exists()  # refused before anything was written
    copied = est.copy()
    assert copied.loggers[0].trial is trial  # a copy reports to the live study
    copied.loggers[0].on_epoch_end({"epoch": 1, "val_loss": 0.5})
    assert study.trials[0].intermediate_values == {1: 0.5}
