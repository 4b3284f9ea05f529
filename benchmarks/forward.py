"""The inference baseline: a plain batched forward pass in one process, every core."""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from torch import nn

__all__ = ["forward_rows_per_s"]


def forward_rows_per_s(model: nn.Module, features: np.ndarray, batch_size: int) -> float:
    """Rows per second of ``model`` over ``features`` in batches, after a one-batch warm-up."""
    torch.set_num_threads(os.cpu_count() or 1)
    model.eval()
    rows = torch.from_numpy(features)
    with torch.inference_mode():
        model(rows[:batch_size])
        started = time.perf_counter()
        outputs = [model(rows[start:start + batch_size]) for start in range(0, len(rows), batch_size)]
        torch.cat(outputs).numpy()
    return len(rows) / (time.perf_counter() - started)
