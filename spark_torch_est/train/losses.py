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

from spark_torch_est.errors import UserCodeError

__all__ = ["Loss", "NonFiniteLossError", "check_weighted", "loss_name", "scalar_loss", "zero_through"]

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
            UserCodeError: With weights, the loss does not give one value per row.
        """
        if weights is None:
            return self.function(outputs, labels)
        values = self.per_row(outputs, labels)
        if not isinstance(values, torch.Tensor) or values.dim() == 0 or len(values) != len(outputs):
            raise UserCodeError.returned(
                f"{self.name} called with reduction='none'" if self.per_row is not self.function else self.name,
                values, f"one value per row with weightCol, a tensor of shape [{len(outputs)}] for this batch",
                "pass a loss module or a function with a reduction keyword (both are called with "
                "reduction='none'), or a callable that returns a (batch,) tensor of per-row losses")
        values = values.reshape(len(values), -1).mean(dim=1)
        weights = weights.to(values.dtype)
        return (values * weights).sum() / weights.sum().clamp_min(torch.finfo(values.dtype).tiny)

    @property
    def name(self) -> str:
        """The user's loss in an error message: ``"the loss (MSELoss)"``."""
        return f"the loss ({loss_name(self.function)})"

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


def loss_name(function: Any) -> str:
    """A loss's name for an error message: its class for a module, else its qualified name."""
    if isinstance(function, Loss):
        function = function.function
    if isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, nn.Module) or not hasattr(function, "__qualname__"):
        return type(function).__qualname__
    return f"function {function.__qualname__}"


def scalar_loss(loss: Any, function: Any) -> torch.Tensor:
    """The loss as ``function`` (the user's loss) returned it, if it is a one-value tensor
    (its shape is read, never its value).

    Raises:
        UserCodeError: It is not (a Python number, a per-row tensor, a tuple, ...), naming the loss.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UserCodeError.returned(f"the loss ({loss_name(function)})", loss, "a tensor holding one value",
                                     "reduce it (e.g. .mean()) and return the tensor, not a Python number")
    return loss


def zero_through(model: nn.Module) -> torch.Tensor:
    """A zero that every trainable parameter reaches, so backward gives each a zero gradient."""
    return sum((0.0 * p.sum() for p in model.parameters() if p.requires_grad), torch.zeros(()))
