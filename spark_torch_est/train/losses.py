"""[both] The loss as the loop, validation and ``evaluate()`` call it, and what the loop
demands of it: one value per batch (:func:`scalar_loss`), finite (:class:`NonFiniteLossError`).

Without sample weights it is the user's loss. With ``weightCol`` every row's loss is
weighted: a loss module is called with ``reduction="none"`` (a copy; the user's object is
left alone), and so is a function that takes a ``reduction`` keyword (every
``torch.nn.functional`` loss, as Horovod calls them); any other callable must itself return
one value per row. The batch's loss is the weighted mean ``sum(w * l) / sum(w)``: summed
over batches and ranks with the batches' total weight, that gives exact weighted means per
epoch. A loss module that reduces otherwise (``reduction="sum"``) is refused with weights
(:func:`check_weighted`), never silently averaged.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Loss", "NonFiniteLossError", "check_weighted", "scalar_loss", "zero_through"]

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Loss:
    """Calls the user's loss, weighted when weights are given.

    Args:
        function: The user's loss: an ``nn.Module`` or ``callable(outputs, labels)``.
    """

    def __init__(self, function: LossFunction) -> None:
        self.function = function
        self._per_row: LossFunction | None = None

    def __call__(self, outputs: torch.Tensor, labels: torch.Tensor,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        """The batch's loss: the user's loss, or with ``weights`` the weighted mean of its
        per-row values.

        Raises:
            TypeError: With weights, the loss does not give one value per row.
        """
        if weights is None:
            return self.function(outputs, labels)
        values = self.per_row(outputs, labels)
        if not isinstance(values, torch.Tensor) or values.dim() == 0 or len(values) != len(outputs):
            shape = list(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise TypeError(
                f"with weightCol the loss must give one value per row, got {shape} for a batch of {len(outputs)}: "
                "pass a loss module or a function with a reduction keyword (both are called with "
                "reduction='none'), or a callable that returns a (batch,) tensor of per-row losses"
            )
        values = values.reshape(len(values), -1).mean(dim=1)
        weights = weights.to(values.dtype)
        return (values * weights).sum() / weights.sum().clamp_min(torch.finfo(values.dtype).tiny)

    @property
    def per_row(self) -> LossFunction:
        """The loss without reduction: a copy of a loss module with ``reduction="none"``, a
        function that takes ``reduction`` called with ``"none"``, else the callable itself."""
        if self._per_row is None:
            function: Callable[..., torch.Tensor] = self.function
            if isinstance(function, nn.Module) and hasattr(function, "reduction"):
                function = copy.copy(function)
                setattr(function, "reduction", "none")  # noqa: B010 - a loss module's plain attribute
            elif not isinstance(function, nn.Module) and _takes_reduction(function):
                function = functools.partial(function, reduction="none")
            self._per_row = function
        return self._per_row


def _takes_reduction(function: Callable[..., Any]) -> bool:
    try:
        return "reduction" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def check_weighted(loss: Any) -> None:
    """Refuses, with ``weightCol``, a loss module whose reduction is not the mean: the
    weighted loss is the weighted mean of the rows' losses.

    Raises:
        ValueError: Names the module and its reduction.
    """
    reduction = getattr(loss, "reduction", "mean") if isinstance(loss, nn.Module) else "mean"
    if reduction != "mean":
        raise ValueError(
            f"with weightCol the loss is the weighted mean of the rows' losses, but {type(loss).__name__} has "
            f"reduction={reduction!r}; use reduction='mean' (scale the learning rate for a sum), or a callable that "
            "returns the rows' losses and weigh them yourself without weightCol")


class NonFiniteLossError(ArithmeticError):
    """The loss or the weights became NaN or infinite (see the ``allowNonFinite`` Param)."""


def scalar_loss(loss: Any) -> torch.Tensor:
    """The loss as given, if it is a one-value tensor.

    Raises:
        TypeError: It is not (a Python number, a per-row tensor, ...).
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"the loss must be a tensor holding one value, got {shape}; reduce it (e.g. .mean()) "
                        "and return a tensor, not a Python number")
    return loss


def zero_through(model: nn.Module) -> torch.Tensor:
    """A zero that every trainable parameter reaches, so backward gives each a zero gradient."""
    return sum((0.0 * p.sum() for p in model.parameters() if p.requires_grad), torch.zeros(()))
