"""[both] The user's creators and hooks, and the one way both sides build objects from them."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from spark_torch_est.train.hooks import Hook

__all__ = ["Creators", "CreatorError"]


class CreatorError(Exception):
    """A creator raised or returned the wrong kind of object.

    Attributes:
        creator: ``"model"``, ``"optimizer"``, ``"scheduler"`` or ``"loss"``.
    """

    def __init__(self, creator: str, message: str) -> None:
        super().__init__(message)
        self.creator = creator


@dataclass
class Creators:
    """What the user passes to ``TorchEstimator``; cloudpickled to every task as one object.

    Attributes:
        model: An ``nn.Module`` (copied per fit) or ``callable(config) -> nn.Module``.
        optimizer: ``callable(model, config) -> torch.optim.Optimizer``; None in a fitted
            model's creators, which train nothing.
        loss: An ``nn.Module``, an ``nn.Module`` class, or ``callable(outputs, labels)``.
        scheduler: ``callable(optimizer, config) -> LR scheduler``, or None.
        metrics: ``{name: callable(outputs, labels) -> tensor | torchmetrics.Metric}``.
        hooks: ``{name: Hook}``.
        config: A plain dict handed to every creator.
        callbacks: Lightning callbacks, for a LightningModule as the model.
    """

    model: nn.Module | Callable[[dict], nn.Module]
    optimizer: Callable[[nn.Module, dict], torch.optim.Optimizer] | None
    loss: nn.Module | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scheduler: Callable[[torch.optim.Optimizer, dict], Any] | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    hooks: Mapping[str, Hook] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    callbacks: list[Any] = field(default_factory=list)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Creators pickled before a field existed (a saved model or estimator) take its default."""
        self.__dict__.update({"callbacks": [], **state})

    def build_model(self) -> nn.Module:
        """Returns a fresh model (a deep copy when the user gave an instance)."""
        if isinstance(self.model, nn.Module):
            return copy.deepcopy(self.model)
        model = _call("model", self.model, dict(self.config))
        if not isinstance(model, nn.Module):
            raise CreatorError("model", f"the model creator returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """Calls the optimizer creator on ``model``.

        Raises:
            CreatorError: There is none (a fitted model's creators), or it returned no optimizer.
        """
        if self.optimizer is None:
            raise CreatorError("optimizer", "no optimizer creator: these creators (a fitted model's) train nothing")
        optimizer = _call("optimizer", self.optimizer, model, dict(self.config))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise CreatorError(
                "optimizer", f"the optimizer creator returned {type(optimizer).__name__}, not a torch.optim.Optimizer"
            )
        return optimizer

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        """Calls the scheduler creator, or returns None without one."""
        if self.scheduler is None:
            return None
        scheduler = _call("scheduler", self.scheduler, optimizer, dict(self.config))
        if not (hasattr(scheduler, "step") and hasattr(scheduler, "state_dict")):
            raise CreatorError(
                "scheduler",
                f"the scheduler creator returned {type(scheduler).__name__}, which has no step()/state_dict()",
            )
        return scheduler

    @property
    def loss_reads_labels_as_read(self) -> bool:
        """A callable loss (not an ``nn.Module``) gets labels of another width than the
        model's output as the label column holds them: they are its business."""
        loss = self.loss
        return not (isinstance(loss, nn.Module) or (isinstance(loss, type) and issubclass(loss, nn.Module)))

    def build_loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Returns the loss callable (instantiating an ``nn.Module`` class)."""
        if isinstance(self.loss, type) and issubclass(self.loss, nn.Module):
            return _call("loss", self.loss)
        return cast(Callable[[torch.Tensor, torch.Tensor], torch.Tensor], self.loss)


def _call(creator: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as error:
        raise CreatorError(creator, f"the {creator} creator raised {type(error).__name__}: {error}") from error
