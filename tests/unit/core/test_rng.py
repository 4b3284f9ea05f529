"""RNG states travel as checked tensors, never as pickles."""

import random

import numpy as np
import pytest
import torch

from spark_torch_est.core import rng

CPU = torch.device("cpu")


def _draw():
    return torch.rand(3).tolist(), random.random(), random.gauss(0, 1), float(np.random.rand()), \
        float(np.random.standard_normal())


def test_a_captured_state_restores_every_generator_exactly():
    random.gauss(0, 1)  # leaves a cached gauss value in the state
    np.random.standard_normal()
    state = rng.capture(CPU)
    first = _draw()
    rng.restore(state, CPU)
    assert _draw() == first


@pytest.mark.parametrize("corrupt", [
    lambda s: s[:-1],                                        # wrong length
    lambda s: torch.cat([torch.tensor([1e9, 0.0]), s[2:]]),  # header that lies
    lambda s: s.index_fill(0, torch.tensor([5]), 256.0),     # a byte out of range
    lambda s: s.index_fill(0, torch.tensor([5]), 0.5),       # not an integer
    lambda s: s.index_fill(0, torch.tensor([len(s) - 3]), 10_000.0),  # numpy position out of range
    lambda s: s.float(),                                     # wrong dtype
    lambda s: s.index_fill(0, torch.tensor([len(s) - 1]), float("nan")),
])
def test_a_malformed_state_from_a_peer_is_refused(corrupt):
    with pytest.raises(ValueError):
        rng.check(corrupt(rng.capture(CPU)))


def test_fresh_runs_seed_per_rank():
    rng.seed_all(7, rank=0)
    a = _draw()
    rng.seed_all(7, rank=1)
    b = _draw()
    rng.seed_all(7, rank=0)
    assert _draw() == a != b
