"""[executor] ``strategy="ddp"`` (the default): every rank holds the whole model, wrapped in
``DistributedDataParallel`` on more than one rank; a checkpoint's ``.pt`` holds the whole
model and optimizer state."""

from __future__ import annotations

import inspect
import weakref
from typing import Any, cast

from torch import nn

from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.core.ranks import Ranks
from spark_torch_est.train.devices import to_cpu
from spark_torch_est.train.strategies.base import SavedStates, Strategy

__all__ = ["DDP"]


class DDP(Strategy):
    """Data parallel: the whole model on every rank, gradients averaged by DDP.

    Args:
        ranks: This rank and its peers.
    """

    name = "ddp"

    def __init__(self, ranks: Ranks) -> None:
        super().__init__(ranks)
        self._ddp: nn.Module | None = None

    def _wrapped(self, model: nn.Module, resumed: bool) -> nn.Module:
        """The model in DDP on several ranks (itself on one)."""
        if self.ranks.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device = self.ranks.device
        ids = [device.index] if device.type == "cuda" else None
        # Resumed, every rank has just loaded the same checked state: DDP's broadcast of
        # all parameters and buffers from rank 0 would only copy it again.
        skip_sync = resumed and "init_sync" in inspect.signature(DistributedDataParallel).parameters
        if skip_sync:
            self._ddp = DistributedDataParallel(model, device_ids=ids, init_sync=False)
        else:
            self._ddp = DistributedDataParallel(model, device_ids=ids)
        return self._ddp

    def restore(self, resume: Checkpoint) -> None:
        self.optimizer.load_state_dict(resume.optimizer_state)

    def saved_states(self, final: bool) -> SavedStates | None:
        if self.ranks.rank != 0:
            return None
        return SavedStates(to_cpu(self.model.state_dict()), to_cpu(self.optimizer.state_dict()))

    def teardown_refs(self) -> list[weakref.ref]:
        """The DDP wrapper and its Reducer, which hold the process group (none on one rank)."""
        ddp = self._ddp
        if ddp is None:
            return []
        refs: list[weakref.ref] = [weakref.ref(ddp)]
        try:
            refs.append(weakref.ref(cast(Any, ddp).reducer))
        except (AttributeError, TypeError):  # no Reducer, or not weakly referenceable
            pass
        return refs
