"""[both] A LightningModule as the model: how it is recognised, and the Lightning releases the
installed torch carries (what the estimator owns of Lightning's ``Trainer`` is refused by the
``trainerArgs`` Param, :func:`spark_torch_est.params.table.to_trainer_args`).

Recognising a module imports nothing: an object is a LightningModule only if its class
comes from ``lightning.pytorch`` or ``pytorch_lightning``, which are then imported already.
The rank's side, Lightning's own loop on the task's process group, is
:mod:`spark_torch_est.train.lightning.trainer`.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, requires, version
from typing import Any

from spark_torch_est.core.schema import call_model

__all__ = ["NAMESPACES", "namespace_of", "defines", "scorer", "step_batch", "trainer_args", "check_release",
           "MIN_LIGHTNING"]

#: The two import names of Lightning's Trainer package, and their distributions.
NAMESPACES = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch-lightning"}
#: The oldest Lightning release the package runs exactly (the ``lightning`` extra's range): 2.4
#: continues a fit stopped in the middle of an epoch other than one straight fit would.
MIN_LIGHTNING = (2, 5)
def namespace_of(model: Any) -> str | None:
    """``"lightning.pytorch"`` or ``"pytorch_lightning"`` when ``model`` is a LightningModule
    of that package, else None (never imports either)."""
    for name in NAMESPACES:
        package = sys.modules.get(name)
        module_class = getattr(package, "LightningModule", None) if package is not None else None
        if module_class is not None and isinstance(model, module_class):
            return name
    return None


def defines(model: Any, method: str) -> bool:
    """Whether ``model`` is a LightningModule whose class defines ``method`` (say
    ``validation_step`` or ``predict_step``) rather than inheriting Lightning's, as Lightning's
    own ``is_overridden`` decides whether its Trainer runs it."""
    namespace = namespace_of(model)
    if namespace is None:
        return False
    inherited = getattr(sys.modules[namespace].LightningModule, method, None)
    return getattr(type(model), method, None) is not inherited


def scorer(model: Any) -> tuple[str, Callable[[Any, int], Any]]:
    """How ``transform``, ``predict_udf`` and the output shape call ``model`` on a batch of
    inputs (:meth:`InputSchema.model_inputs`: the features, or the tuple of typed inputs),
    and the method's name for messages: a LightningModule's own ``predict_step(batch,
    batch_idx)`` where its class defines one, else the module's forward, ``model(*inputs)``."""
    if defines(model, "predict_step"):
        return "predict_step", model.predict_step
    return "forward", lambda inputs, batch_idx: call_model(model, inputs)


def step_batch(model_inputs: Any, labels: Any, weights: Any = None) -> tuple:
    """A batch as the module's steps take it, in training, validation and ``evaluate``:
    ``(features, label)``, ``(*inputs, label)`` for typed inputs (``model_inputs`` a tuple),
    the weight last under ``weightCol``."""
    parts = list(model_inputs) if isinstance(model_inputs, tuple) else [model_inputs]
    return (*parts, labels, *([weights] if weights is not None else []))


def trainer_args(namespace: str, device: Any, precision: str) -> dict[str, Any]:
    """The arguments of a Trainer on one rank's ``device`` (a ``torch.device``), at the
    ``precision`` Param, in training and ``evaluate``; quiets Lightning's per-Trainer
    "GPU available: ..." lines."""
    logging.getLogger(f"{namespace}.utilities.rank_zero").setLevel(logging.WARNING)
    cuda = device.type == "cuda"
    return {"accelerator": "gpu" if cuda else "cpu", "devices": [device.index or 0] if cuda else 1,
            "precision": _PRECISIONS[precision]}


#: The precision Param as Lightning names it.
_PRECISIONS = {"32": "32-true", "16-mixed": "16-mixed", "bf16-mixed": "bf16-mixed"}


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def check_release(namespace: str, torch_version: str | None = None) -> None:
    """Refuses a Lightning release this package does not run, or one the installed torch
    (``torch_version``: that release instead) cannot carry: the torch range the installed
    Lightning release declares.

    Raises:
        ValueError: Names both releases and what is needed.
    """
    distribution = NAMESPACES[namespace]
    try:
        lightning_version = version(distribution)
    except PackageNotFoundError:  # imported from a source tree: trust it
        return
    if _release(lightning_version)[:2] < MIN_LIGHTNING:
        needed = ".".join(map(str, MIN_LIGHTNING))
        raise ValueError(f"a LightningModule needs {distribution} >= {needed}; this environment has {distribution} "
                         f"{lightning_version}: pip install 'spark-torch-est[lightning]'")
    torch_text = torch_version or version("torch")
    have_torch = _release(torch_text)
    for line in requires(distribution) or []:
        match = re.match(r"torch\s*([^;]*)$", line.strip())
        if match is None:
            continue
        for op, bound in re.findall(r"(>=|<=|<|>|==|!=)\s*([\d.]+)", match.group(1)):
            wanted = _release(bound)
            have = have_torch[:len(wanted)]
            fits = {">=": have >= wanted, ">": have > wanted, "<=": have <= wanted, "<": have < wanted,
                    "==": have == wanted, "!=": have != wanted}[op]
            if not fits:
                raise ValueError(f"{distribution} {lightning_version} needs torch {match.group(1).strip()}; this "
                                 f"environment has torch {torch_text}: install a {distribution} release that "
                                 "supports it")
