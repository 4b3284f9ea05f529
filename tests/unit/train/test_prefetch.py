"""Batches copied one step ahead: the order of copies, waits and use, checked with a
transfer that records it (the CUDA transfer itself runs in scripts/gpu_smoke.py)."""

from __future__ import annotations

import torch

from spark_torch_est.train.prefetch import map_tensors, prefetch, transfer_for


class Recording:
    """A Transfer that tags each batch instead of copying it, and logs every call."""

    def __init__(self, log: list):
        self.log = log

    def start(self, batch):
        self.log.append(("start", batch[0]))
        return ("copying", batch)

    def finish(self, started):
        self.log.append(("finish", started[1][0]))
        return ("on device", started[1])


def _source(count: int, log: list):
    for i in range(count):
        log.append(("take", i))
        yield (i, torch.full((2,), float(i)))


def test_the_next_batch_is_copied_while_the_current_one_is_used():
    log = []
    for status, (i, _) in prefetch(_source(3, log), Recording(log)):
        assert status == "on device"
        log.append(("use", i))
    assert log == [("take", 0), ("start", 0),
                   ("finish", 0), ("take", 1), ("start", 1), ("use", 0),   # 1's copy overlaps 0's step
                   ("finish", 1), ("take", 2), ("start", 2), ("use", 1),
                   ("finish", 2), ("use", 2)]


def test_a_loop_that_stops_early_has_started_at_most_one_batch_more():
    log = []
    batches = prefetch(_source(10, log), Recording(log))
    for _ in range(2):
        next(batches)
    assert [entry for entry in log if entry[0] == "start"] == [("start", 0), ("start", 1), ("start", 2)]


def test_on_the_cpu_batches_pass_unchanged_and_are_taken_only_when_asked_for():
    assert transfer_for(torch.device("cpu")) is None
    log = []
    batches = prefetch(_source(3, log), None)
    first = next(batches)
    assert log == [("take", 0)]
    assert first[0] == 0 and torch.equal(first[1], torch.zeros(2))
    assert [i for i, _ in batches] == [1, 2]


def test_every_tensor_of_a_batch_moves_and_the_rest_stays():
    batch = ([torch.ones(1), torch.zeros(2)], torch.ones(3), None)
    moved = map_tensors(lambda x: x + 1, batch)
    assert isinstance(moved, tuple) and isinstance(moved[0], list) and moved[2] is None
    assert [x.tolist() for x in moved[0]] == [[2.0], [1.0, 1.0]] and moved[1].tolist() == [2.0, 2.0, 2.0]
