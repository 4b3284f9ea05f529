"""[both] Where each module of the flat layout (up to 0.1.0) lives now.

Saved models, estimators and checkpoints pickle the package's creators, hooks and loggers by
module path (``spark_torch_est.builtin_hooks.EarlyStopping``), and users' code imports
them by it. :func:`install` puts a finder on ``sys.meta_path`` that answers an old name with
the module that lives under the new one, so both keep working; new pickles name the new
module. A module that moves again gets a row here; a row stays while its module exists
(``balance``, which no pickle named, is gone: the logical shards of
:mod:`~spark_torch_est.ingest.canonical` even out the ranks' rows).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

__all__ = ["MOVED", "install"]

_PACKAGE = "spark_torch_est"

#: Old module (relative to the package) -> its home now.
MOVED = {
    "spec": "core.spec", "progress": "core.progress", "duration": "core.duration", "ranks": "core.ranks",
    "rng": "core.rng", "protocol": "core.protocol", "schema": "core.schema", "support": "core.support",
    "running": "core.running", "jvm": "core.jvm",
    "param_table": "params.table", "param_codegen": "params.codegen", "params_columns": "params.columns",
    "params_runtime": "params.runtime", "params_training": "params.training",
    "frames": "ingest.frames", "sources": "ingest.parquet_plan", "files": "ingest.parquet_read",
    "data": "ingest.shard", "columns": "ingest.rows", "kept": "ingest.kept", "ingest_cache": "ingest.kept_registry",
    "agreement": "ingest.agreement",
    "loop": "train.loop", "step": "train.step", "run_state": "train.run_state", "hooks": "train.hooks",
    "builtin_hooks": "train.builtin_hooks", "creators": "train.creators", "losses": "train.losses",
    "metrics": "train.metrics", "precision": "train.precision", "prefetch": "train.prefetch",
    "devices": "train.devices", "sharding": "train.strategies.fsdp",
    "checkpoint": "checkpoints.checkpoint", "storage": "checkpoints.storage",
    "launcher": "cluster.launcher", "worker": "cluster.worker", "barrier": "cluster.barrier",
    "rendezvous": "cluster.rendezvous", "store_gate": "cluster.store_gate", "authenticated": "cluster.authenticated",
    "channel": "cluster.channel", "messages": "cluster.messages", "failure": "cluster.failure",
    "spark_log": "cluster.spark_log",
    "inference": "scoring.inference", "udf": "scoring.predict_udf",
    "loggers.optuna_pruning": "tuning.optuna",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``spark_torch_est.<old>`` as the module now at ``spark_torch_est.<new>``."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, old = fullname.partition(".")
        if prefix != _PACKAGE or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(f"{_PACKAGE}.{MOVED[spec.name.partition('.')[2]]}")
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the old name's spec on the module: give it back its own
        stamped = module.__spec__
        if stamped is not None:
            module.__spec__ = self._specs.pop(stamped.name)


_FINDER = _MovedFinder()


def install() -> None:
    """Lets the old module names import (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
