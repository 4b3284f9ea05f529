"""[both] A LightningModule as the model: how it is recognised, and the Lightning releases the
installed torch carries (what the estimator owns of Lightning's ``Trainer`` is refused by the
``trainerArgs`` Param, :func:`spark_torch_est.params.table.to_trainer_args`).

Recognising a module imports nothing: an object is a LightningModule only if its class
comes from ``lightning.pytorch`` or ``pytorch_lightning``, which are then imported already.
The rank's side, Lightning's own loop on the task's process group, is
:mod:`spark_torch_est.train.lightning.trainer`.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, requires, version
from typing import Any

__all__ = ["NAMESPACES", "namespace_of", "check_release", "MIN_LIGHTNING"]

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
