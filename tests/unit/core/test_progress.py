"""Progress advanced by methods, and the Target that is the one home of the stop rule."""

import pytest

from spark_torch_est import Duration, Progress
from spark_torch_est.core.progress import Interval, Target
from spark_torch_est.errors import InvalidInputError, TrainingCompleteError


def test_progress_advances_by_steps_and_epochs_without_changing_in_place():
    start = Progress()
    stepped = start.to_next_batch(samples=100).to_next_batch(samples=60)
    assert start == Progress()
    assert stepped == Progress(epoch=0, batch_in_epoch=2, global_step=2, samples=160, sample_in_epoch=160)
    assert stepped.to_next_epoch() == Progress(epoch=1, batch_in_epoch=0, global_step=2, samples=160)
    assert Progress.from_dict(stepped.to_dict()) == stepped
    with pytest.raises(KeyError, match="sample_in_epoch"):  # every counter is written, so one missing is damage
        Progress.from_dict({"epoch": 1, "batch_in_epoch": 0, "global_step": 2, "samples": 160})


@pytest.mark.parametrize("duration, expected", [
    (None, Target(epoch=5)),
    ("3ep", Target(epoch=5)),          # capped at maxEpochs
    ("1ep", Target(epoch=5)),
    ("150ba", Target(epoch=5, global_step=190)),
    ("1_000sp", Target(epoch=5, samples=1640)),
])
def test_a_fit_target_is_absolute_and_never_past_max_epochs(duration, expected):
    start = Progress(epoch=4, global_step=40, samples=640)
    assert Target.after(start, Duration.parse(duration) if duration else None, max_epochs=5) == expected


def test_a_complete_run_refuses_with_the_way_on():
    with pytest.raises(TrainingCompleteError, match=r"maxEpochs=5.*reset\(\)"):
        Target.after(Progress(epoch=5), None, max_epochs=5)


def test_reached_by_any_counter():
    target = Target(epoch=3, global_step=100, samples=5000)
    assert not target.reached(Progress(epoch=2, global_step=99, samples=4999))
    assert target.reached(Progress(epoch=3))
    assert target.reached(Progress(global_step=100))
    assert target.reached(Progress(samples=5000))


def test_steps_left_counts_the_nearest_limit():
    start = Progress(epoch=1, batch_in_epoch=4, global_step=14, samples=1400)
    assert Target(epoch=3).steps_left(start, steps_per_epoch=10, samples_per_step=100) == 16
    assert Target(epoch=3, global_step=20).steps_left(start, 10, 100) == 6
    assert Target(epoch=3, samples=1650).steps_left(start, 10, 100) == 3


def test_a_checkpoint_interval_is_due_at_its_multiples_of_its_own_unit():
    every = Interval.parse("3ba")
    assert [step for step in range(1, 10) if every.due(Progress(global_step=step), "ba")] == [3, 6, 9]
    assert not every.due(Progress(epoch=3, global_step=3), "ep")
    assert Interval.parse("1ep").due(Progress(epoch=2, global_step=7), "ep")
    with pytest.raises(InvalidInputError, match="counts epochs or batches"):
        Interval.parse("100sp")
