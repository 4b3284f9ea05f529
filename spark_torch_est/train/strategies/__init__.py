"""[both] How a rank's model is distributed: one class per strategy, :class:`~.ddp.DDP`
and :class:`~.fsdp.FSDP`, behind :class:`~.base.Strategy`, and the registry of them (the
driver reads it to check a fit, the executors to build their strategy).

:data:`STRATEGIES` is the one list of the ``strategy`` Param's values: the driver checks the
Param against it (see ``params/table.py``) and asks the class it names for its checks
(releases, checkpointDir, the model: see :class:`~.base.Strategy`); each task builds its
strategy from it (:func:`for_spec`). A new strategy is one more module here, and one more
class in :data:`STRATEGIES`.
"""

from __future__ import annotations

from spark_torch_est.core.ranks import Ranks
from spark_torch_est.core.spec import TaskSpec
from spark_torch_est.train.strategies.base import Strategy
from spark_torch_est.train.strategies.ddp import DDP
from spark_torch_est.train.strategies.fsdp import FSDP

__all__ = ["Strategy", "DDP", "FSDP", "STRATEGIES", "for_spec"]

#: The strategies by the ``strategy`` Param's value that names them.
STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (DDP, FSDP)}


def for_spec(spec: TaskSpec, ranks: Ranks) -> Strategy:
    """The strategy the fit's ``strategy`` Param names (checked on the driver)."""
    return STRATEGIES[spec.strategy].for_spec(spec, ranks)
