"""[both] What a strategy does for the loop, one class per strategy (:mod:`.ddp`,
:mod:`.fsdp`): the module a step calls, what a checkpoint holds of the model and its
optimizer, the full weights at the end of a fit, and what the teardown must see freed.

The class also says what the driver checks before any job (its class attributes and
classmethods: the releases it needs, whether it needs a checkpointDir, the model it can
take), so that planning asks the strategy the ``strategy`` Param names and never compares
names. The loop and the run's state ask the fit's strategy; neither knows which one it is.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from spark_torch_est.checkpoints.checkpoint import Checkpoint, check_compatible
from spark_torch_est.core.ranks import Ranks
from spark_torch_est.core.support import Feature
from spark_torch_est.errors import InvalidInputError

if TYPE_CHECKING:
    from spark_torch_est.core.spec import TaskSpec
    from spark_torch_est.train.creators import Creators

__all__ = ["Strategy", "SavedStates"]


@dataclass(frozen=True)
class SavedStates:
    """What a checkpoint's ``.pt`` holds of the model and its optimizer.

    Attributes:
        model: The model's state (the full weights, or ``{}`` where the parts hold them).
        optimizer: The optimizer's state, or ``{}`` where the parts hold it.
        sharded: Where the parts of a sharded checkpoint lie (see :mod:`.fsdp`), or None.
    """

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    sharded: dict[str, Any] | None = None


class Strategy(ABC):
    """How one rank's model is distributed over the ranks.

    Call order: :meth:`load_weights` and :meth:`wrap` (the model), :meth:`attach` (its
    optimizer), then :meth:`restore` when the fit resumes; the other methods from then on.

    Args:
        ranks: This rank and its peers.

    Attributes:
        model: The model (not wrapped), once wrapped.
        optimizer: Its optimizer, once attached.
    """

    #: The ``strategy`` Param's value for this class (its key in the registry,
    #: :data:`spark_torch_est.train.strategies.STRATEGIES`).
    name: ClassVar[str] = ""
    #: The releases it needs on any ranks, and those it needs besides on CPU ranks (see
    #: :mod:`spark_torch_est.core.support`): the driver refuses it before any job without them.
    needs: ClassVar[tuple[Feature, ...]] = ()
    needs_on_cpu: ClassVar[tuple[Feature, ...]] = ()
    #: Whether every rank writes its part of each checkpoint (so a fit needs a checkpointDir
    #: every rank reaches) and the run's optimizer state is kept in those parts, not whole.
    sharded: ClassVar[bool] = False

    @classmethod
    def check_settings(cls, checkpoint_dir: str | None) -> None:
        """Refuses, on the driver, the fit's settings this strategy cannot run with.

        Raises:
            InvalidInputError: It writes sharded checkpoints and ``checkpoint_dir`` is unset.
        """
        if cls.sharded and not checkpoint_dir:
            raise InvalidInputError(
                f'strategy="{cls.name}" writes sharded checkpoints, each rank its part, so it needs checkpointDir: '
                f"set it to storage every worker reaches (a shared filesystem, DBFS, HDFS or an object store); got "
                f"checkpointDir={checkpoint_dir!r}")

    @classmethod
    def model_to_check(cls, creators: Creators) -> nn.Module:
        """The model the driver builds to check the creators before any job."""
        return creators.build_model()

    @classmethod  # noqa: B027 - most strategies take any model
    def check_model(cls, model: nn.Module, shard_modules: Sequence[str] | None) -> None:
        """Refuses, on the driver, a model (built by :meth:`model_to_check`) this strategy
        cannot train; ``shard_modules``: the ``shardModules`` Param."""

    @classmethod
    def for_spec(cls, spec: TaskSpec, ranks: Ranks) -> Strategy:
        """The strategy of a task of the fit ``spec``, on ``ranks``."""
        return cls(ranks)

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.model: nn.Module
        self.optimizer: torch.optim.Optimizer

    def load_weights(self, model: nn.Module, resume: Checkpoint | None) -> None:
        """Loads the run's weights into ``model`` (not yet wrapped) where ``resume`` holds
        them whole; a sharded checkpoint's are loaded by :meth:`restore`.

        Raises:
            IncompatibleCheckpointError: The saved state does not fit the model.
        """
        if resume is not None and resume.sharded is None:
            check_compatible(model.state_dict(), resume.model_state)
            model.load_state_dict(resume.model_state)

    def wrap(self, model: nn.Module, resumed: bool) -> nn.Module:
        """The module a step calls: ``model`` itself, or a wrapper of it. Collective."""
        self.model = model
        return self._wrapped(model, resumed)

    @abstractmethod
    def _wrapped(self, model: nn.Module, resumed: bool) -> nn.Module:
        """The module a step calls, around ``model`` (which holds the run's weights if the
        checkpoint had them whole)."""

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Takes the optimizer of the wrapped model."""
        self.optimizer = optimizer

    @abstractmethod
    def restore(self, resume: Checkpoint) -> None:
        """Loads the optimizer's state (and whatever of the model :meth:`wrap` did not) from
        ``resume``. Collective.

        Raises:
            IncompatibleCheckpointError: ``resume`` does not hold what this strategy needs.
        """

    def save_parts(self, url: str, global_step: int) -> None:  # noqa: B027 - most strategies have no parts
        """Writes the parts of a checkpoint that live outside its ``.pt`` into the folder
        ``url``: none, unless the strategy shards the state. Collective."""

    def parts_behind(self, global_step: int) -> bool:
        """Whether the fit's last checkpoint needs parts written at ``global_step`` first."""
        return False

    @abstractmethod
    def saved_states(self, final: bool) -> SavedStates | None:
        """What the checkpoint's ``.pt`` holds of the model and optimizer, on rank 0 (None on
        the others); ``final``: the fit's last, which the driver keeps (it holds the full
        weights). Collective."""

    def forward_passes(self, mine: int) -> int:
        """How many forward passes this rank makes in a validation where it has ``mine``
        batches: as many, unless the ranks must make them together."""
        return mine

    def teardown_refs(self) -> list[weakref.ref]:
        """Weak references to what holds the process group and must be freed before it is
        destroyed (see :func:`spark_torch_est.cluster.worker._teardown`)."""
        return []
