"""[executor] How a rank's model is distributed: one class per strategy, :class:`~.ddp.DDP`
and :class:`~.fsdp.FSDP`, behind :class:`~.base.Strategy`. A new strategy is one more
module here, and one more entry in :func:`for_spec`."""

from __future__ import annotations

from spark_torch_est.core.ranks import Ranks
from spark_torch_est.core.spec import TaskSpec
from spark_torch_est.train.strategies.base import Strategy
from spark_torch_est.train.strategies.ddp import DDP
from spark_torch_est.train.strategies.fsdp import FSDP

__all__ = ["Strategy", "DDP", "FSDP", "for_spec"]


def for_spec(spec: TaskSpec, ranks: Ranks) -> Strategy:
    """The strategy the fit's ``strategy`` Param names."""
    if spec.strategy == FSDP.name:
        return FSDP(ranks, spec.shard_modules)
    return DDP(ranks)
