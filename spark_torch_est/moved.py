"""[driver] Where each module of the flat layout (up to 0.1.0) lives now, for what it saved.

Saved models and estimators pickle the package's creators, hooks and loggers by module path
(``spark_torch_est.builtin_hooks.EarlyStopping``). :func:`loads` unpickles them with a
redirecting unpickler: an old module name is read as its home now, and a load that needed it
logs one warning. Old names resolve only there, while a saved stage is loaded: nothing is
installed on ``sys.meta_path``, so ``import spark_torch_est.<old>`` fails and an old name
never shadows a new one. What was loaded holds the classes of the new modules, so anything
pickled from it again (a saved stage, the creators shipped to the executors) names the new
ones. A module that moves again gets a row here; rows are never removed while their module
exists (``balance``, which no pickle named, is gone: the logical shards of
:mod:`~spark_torch_est.ingest.canonical` even out the ranks' rows).
"""

from __future__ import annotations

import importlib
import io
import logging
import pickle
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "loads", "current_name"]

logger = logging.getLogger(__name__)

_PACKAGE = "spark_torch_est"

#: Old module (relative to the package) -> its home now.
MOVED = {
    "spec": "core.spec", "progress": "core.progress", "duration": "core.duration", "ranks": "core.ranks",
    "rng": "core.rng", "protocol": "core.protocol", "schema": "core.schema", "support": "core.support",
    "running": "core.running", "jvm": "core.jvm",
    "param_table": "params.table", "param_codegen": "params.codegen", "params_columns": "params.columns",
    "params_runtime": "params.runtime", "params_training": "params.training",
    "frames": "ingest.frames", "sources": "ingest.parquet_plan", "files": "ingest.parquet_read",
    "data": "ingest.tables", "columns": "ingest.columns", "kept": "ingest.kept", "ingest_cache": "ingest.kept_registry",
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

#: cloudpickle's import of a module a function pickled by value refers to.
_SUBIMPORTS = {("cloudpickle.cloudpickle", "subimport"), ("cloudpickle", "subimport")}


def current_name(module: str) -> str:
    """The module's name now: ``spark_torch_est.<old>`` of :data:`MOVED` as its new home,
    any other name as it is."""
    prefix, _, rest = module.partition(".")
    if prefix == _PACKAGE and rest in MOVED:
        return f"{_PACKAGE}.{MOVED[rest]}"
    return module


class _RedirectingUnpickler(pickle.Unpickler):
    """Unpickles with the old module names of :data:`MOVED` read as their homes now,
    remembering which it met."""

    def __init__(self, blob: bytes) -> None:
        super().__init__(io.BytesIO(blob))
        self.redirected: set[str] = set()

    def _current(self, module: str) -> str:
        now = current_name(module)
        if now != module:
            self.redirected.add(module)
        return now

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SUBIMPORTS:
            return self._subimport
        return super().find_class(self._current(module), name)

    def _subimport(self, name: str) -> ModuleType:
        return importlib.import_module(self._current(name))


def loads(blob: bytes, what: str) -> Any:
    """Unpickles ``blob`` (cloudpickle's or pickle's) with the old module names of
    :data:`MOVED` read as their homes now; logs one warning naming ``what`` when it held any.

    Args:
        blob: The pickled bytes.
        what: What they are, for the warning (a file's path).
    """
    unpickler = _RedirectingUnpickler(blob)
    loaded = unpickler.load()
    if unpickler.redirected:
        logger.warning("%s names modules by their 0.1.0 paths (%s); they were loaded from their homes now. Save it "
                       "again to store the current names", what, ", ".join(sorted(unpickler.redirected)))
    return loaded
