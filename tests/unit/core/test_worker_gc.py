"""What a task freezes out of the collection pyspark runs after it, and what still gets freed."""

from __future__ import annotations

import gc
import weakref

import pytest
from torch import nn

from spark_torch_est.core.worker_gc import freeze_older, unfreeze_if_alive


class _Cyclic(nn.Module):
    """A model that refers to itself (a hook bound to the module does so)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.me = [self]


@pytest.fixture(autouse=True)
def unfrozen():
    gc.collect()
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_objects_alive_when_a_task_starts_are_left_out_of_later_collections():
    freeze_older()
    assert gc.get_freeze_count() > 1000  # the interpreter's, torch's, pytest's objects


def test_a_dropped_model_that_a_cycle_keeps_alive_goes_back_to_the_collector():
    model = _Cyclic()
    freeze_older()
    dropped = weakref.ref(model)
    del model
    gc.collect()
    assert dropped() is not None  # frozen: the collection does not look at it
    unfreeze_if_alive(dropped)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert dropped() is None


def test_a_dropped_model_without_a_cycle_is_freed_and_the_rest_stays_frozen():
    model = nn.Linear(4, 1)
    freeze_older()
    dropped = weakref.ref(model)
    del model
    assert dropped() is None  # freed by its reference count, frozen or not
    unfreeze_if_alive(dropped)
    assert gc.get_freeze_count() > 1000
