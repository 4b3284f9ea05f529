"""[driver] Tuning: successive halving on exact resume (:mod:`.halving`) and Optuna's
pruning (:mod:`.optuna`)."""

from __future__ import annotations

from spark_torch_est.tuning.halving import SuccessiveHalving, SuccessiveHalvingModel, param_map_name
from spark_torch_est.tuning.optuna import OptunaPruning

__all__ = ["SuccessiveHalving", "SuccessiveHalvingModel", "OptunaPruning", "param_map_name"]
