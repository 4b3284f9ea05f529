"""[executor] A rank's random number generator states (torch, CUDA, Python, numpy) as one
float64 tensor, so that ranks gather them with a plain tensor collective and the
checkpoint holds them as tensors. Nothing a peer sends is ever unpickled: a state read
from another rank is checked value by value before it is used.

Layout (every value is an integer below 2**53 or a float, so float64 holds it exactly)::

    [n_torch, n_cuda, torch bytes (n_torch), cuda bytes (n_cuda),
     python version, 625 Mersenne Twister words, has_gauss, gauss,
     624 numpy words, numpy pos, numpy has_gauss, numpy cached_gaussian]
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["capture", "restore", "check", "seed_all"]

_MT_WORDS = 624
_TAIL = 1 + (_MT_WORDS + 1) + 2 + _MT_WORDS + 3  # python and numpy parts


def capture(device: torch.device) -> torch.Tensor:
    """This process's RNG states (and ``device``'s CUDA state) as one tensor."""
    torch_state = torch.get_rng_state().double()
    cuda_state = (torch.cuda.get_rng_state(device).double() if device.type == "cuda"
                  else torch.zeros(0, dtype=torch.float64))
    version, words, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=True)
    if isinstance(numpy_state, dict):  # only a bit generator other than MT19937 has no tuple form
        raise TypeError("numpy's global random generator is not an MT19937; its state cannot be captured")
    _, keys, pos, has_gauss, cached = numpy_state
    tail = [version, *words, gauss is not None, gauss or 0.0, *keys.tolist(), pos, has_gauss, cached]
    head = torch.tensor([len(torch_state), len(cuda_state)], dtype=torch.float64)
    return torch.cat([head, torch_state, cuda_state, torch.tensor(tail, dtype=torch.float64)])


def check(state: torch.Tensor) -> None:
    """Raises ValueError unless ``state`` is a well-formed :func:`capture` tensor."""
    if state.dtype != torch.float64 or state.dim() != 1 or len(state) < 2:
        raise ValueError("an RNG state must be a 1-d float64 tensor")
    n_torch, n_cuda = (int(v) for v in state[:2])
    if n_torch < 1 or n_cuda < 0 or len(state) != 2 + n_torch + n_cuda + _TAIL:
        raise ValueError(f"an RNG state of {len(state)} values does not match its header ({n_torch}, {n_cuda})")
    values = state.numpy()
    byte_part = values[2:2 + n_torch + n_cuda]
    tail = values[2 + n_torch + n_cuda:]
    words = np.concatenate([tail[1:1 + _MT_WORDS + 1], tail[3 + _MT_WORDS + 1:3 + 2 * _MT_WORDS + 1]])
    integral = np.concatenate([byte_part, words, tail[[0, _MT_WORDS + 1 + 1, -3, -2]]])
    if not (np.isfinite(values).all() and (integral == np.floor(integral)).all()):
        raise ValueError("an RNG state holds non-integral values where integers belong")
    if byte_part.min(initial=0) < 0 or byte_part.max(initial=0) > 255 or words.min() < 0 or words.max() >= 2 ** 32:
        raise ValueError("an RNG state holds values out of range")
    if not 0 <= tail[1 + _MT_WORDS] <= _MT_WORDS or not 0 <= tail[-3] <= _MT_WORDS:
        raise ValueError("an RNG state holds a position out of range")


def restore(state: torch.Tensor, device: torch.device) -> None:
    """Sets this process's RNG states from a :func:`capture` tensor (checked first)."""
    check(state)
    n_torch, n_cuda = (int(v) for v in state[:2])
    torch.set_rng_state(state[2:2 + n_torch].to(torch.uint8))
    if n_cuda and device.type == "cuda":
        torch.cuda.set_rng_state(state[2 + n_torch:2 + n_torch + n_cuda].to(torch.uint8), device)
    tail = state[2 + n_torch + n_cuda:].tolist()
    words = tuple(int(v) for v in tail[1:1 + _MT_WORDS + 1])
    has_gauss, gauss = tail[_MT_WORDS + 2], tail[_MT_WORDS + 3]
    random.setstate((int(tail[0]), words, gauss if has_gauss else None))
    keys = np.asarray(tail[_MT_WORDS + 4:2 * _MT_WORDS + 4], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, int(tail[-3]), int(tail[-2]), float(tail[-1])))


def seed_all(seed: int, rank: int) -> None:
    """Seeds torch, Python and numpy with a stream of ``(seed, rank)`` (a fresh run)."""
    stream = int(np.random.SeedSequence([seed, 1 << 20, rank]).generate_state(1)[0])
    torch.manual_seed(stream)
    random.seed(stream)
    np.random.seed(stream)
