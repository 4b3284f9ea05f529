"""[both] The ``precision`` Param: the autocast a step's forward and loss run under, and
the gradient scaler of ``"16-mixed"``.

============  =========================================  ================================
precision     forward and loss                           backward and step
============  =========================================  ================================
"32"          float32                                    plain
"bf16-mixed"  ``torch.autocast(dtype=torch.bfloat16)``   plain
"16-mixed"    ``torch.autocast(dtype=torch.float16)``    through a ``torch.amp.GradScaler``
============  =========================================  ================================

Weights, gradients and optimizer state stay float32 under every precision; the scaler's
state travels in the checkpoint, so a run resumed under ``"16-mixed"`` goes on with the
scale it had. The same autocast runs validation, ``evaluate`` and ``transform``.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

__all__ = ["PRECISIONS", "Precision", "autocast"]

#: The values of the ``precision`` Param, and the autocast dtype of each (None: no autocast).
PRECISIONS: dict[str, torch.dtype | None] = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """The context a forward pass (and its loss) runs in under ``precision`` on ``device``."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class Precision:
    """One rank's precision: its autocast and its gradient scaler.

    The scaler is always there, so a ``train_step`` override can use the usual recipe
    (``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``, ``scaler.update()``)
    under every precision: it is enabled only under ``"16-mixed"`` and passes everything
    through otherwise.

    Args:
        name: A key of :data:`PRECISIONS`.
        device: The rank's device.

    Raises:
        ValueError: ``"bf16-mixed"`` on a GPU without bfloat16.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        if name == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"precision='bf16-mixed' needs a GPU with bfloat16 (Ampere or newer), but "
                             f"{torch.cuda.get_device_name(device)} has none; use precision='16-mixed'")
        self.name = name
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type, enabled=name == "16-mixed")

    def autocast(self) -> AbstractContextManager:
        """The context of a forward pass and its loss."""
        return autocast(self.name, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, through the scaler under ``"16-mixed"``."""
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the gradients by the scale, so hooks after the backward pass see (and
        clip) the true gradients. Does nothing without a scaler."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under ``"16-mixed"`` skipped when a gradient is not
        finite, and the scale adjusted."""
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict | None:
        """The scaler's state (plain numbers), or None without a scaler."""
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_state_dict(self, state: dict | None) -> None:
        """Restores the scaler's state; a run that had none (another precision) starts a
        new scale."""
        if state and self.scaler.is_enabled():
            self.scaler.load_state_dict(state)
