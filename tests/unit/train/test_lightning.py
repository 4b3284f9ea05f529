"""A LightningModule as the model, on the driver: recognised without importing Lightning,
its Trainer's owned arguments and the releases torch cannot carry refused (docs/lightning.md)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest
import torch

from spark_torch_est import TorchEstimator
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.planning import check_creators, lightning_of
from spark_torch_est.train.lightning import check_release, namespace_of


def test_a_plain_fit_plan_does_not_import_lightning():
    """Planning a plain module's fit (recognising its model) imports neither Lightning package."""
    code = (
        "import sys, torch\n"
        "from spark_torch_est import TorchEstimator\n"
        "from spark_torch_est.planning import check_creators, lightning_of\n"
        "est = TorchEstimator(model=lambda c: torch.nn.Linear(2, 1), optimizer=lambda m, c: "
        "torch.optim.SGD(m.parameters(), 0.1), loss=torch.nn.MSELoss())\n"
        "assert lightning_of(est._creators) is None\n"
        "check_creators(est, est._creators, None)\n"
        "print(sorted(n for n in ('lightning', 'pytorch_lightning') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_both_lightning_packages_are_recognised():
    lightning = pytest.importorskip("lightning.pytorch")

    class Lit(lightning.LightningModule):
        pass

    assert namespace_of(Lit()) == "lightning.pytorch"
    assert namespace_of(torch.nn.Linear(1, 1)) is None
    est = TorchEstimator(model=lambda config: Lit())
    assert lightning_of(est._creators) == "lightning.pytorch"  # a creator's module
    ptl = pytest.importorskip("pytorch_lightning")

    class OldStyle(ptl.LightningModule):
        pass

    assert namespace_of(OldStyle()) == "pytorch_lightning"


def test_optimizer_or_loss_beside_a_module_is_refused_naming_configure_optimizers():
    lightning = pytest.importorskip("lightning.pytorch")

    class Lit(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

    for extra in ({"optimizer": lambda m, c: torch.optim.SGD(m.parameters(), 0.1)}, {"loss": torch.nn.MSELoss()},
                  {"scheduler": lambda o, c: None}):
        est = TorchEstimator(model=Lit(), **extra)
        with pytest.raises(InvalidInputError, match="configure_optimizers"):
            check_creators(est, est._creators, None)
    est = TorchEstimator(model=Lit(), trainerArgs={"gradient_clip_vall": 1.0})
    with pytest.raises(InvalidInputError, match="trainerArgs 'gradient_clip_vall' is not an argument"):
        check_creators(est, est._creators, None)
    est = TorchEstimator(model=Lit(), strategy="fsdp")
    with pytest.raises(InvalidInputError, match="strategy='ddp'"):
        check_creators(est, est._creators, None)
    est = TorchEstimator(model=Lit(), callbacks=[object()])
    with pytest.raises(InvalidInputError, match="callbacks must be lightning.pytorch.Callback"):
        check_creators(est, est._creators, None)


@pytest.mark.parametrize("key", ["devices", "num_nodes", "strategy", "max_epochs", "accelerator",
                                 "use_distributed_sampler", "precision"])
def test_trainer_args_the_estimator_owns_are_refused_naming_the_key(key):
    with pytest.raises(InvalidInputError, match=f"trainerArgs may not set '{key}'"):
        TorchEstimator(model=torch.nn.Linear(1, 1), trainerArgs={key: 1})
    with pytest.raises(TypeError, match=f"trainerArgs may not set '{key}'"):
        TorchEstimator(model=torch.nn.Linear(1, 1)).setTrainerArgs({key: 1})


def test_trainer_args_are_json_values_kept_as_a_param():
    est = TorchEstimator(model=torch.nn.Linear(1, 1), trainerArgs={"gradient_clip_val": 0.5})
    assert est.getTrainerArgs() == {"gradient_clip_val": 0.5}
    with pytest.raises(InvalidInputError, match="trainerArgs must be a plain dict"):
        TorchEstimator(model=torch.nn.Linear(1, 1), trainerArgs={"profiler": object()})


def test_a_release_that_torch_cannot_carry_is_refused():
    """The installed Lightning declares the torch it needs; an older torch is refused with both
    releases named (and the installed pair is accepted)."""
    pytest.importorskip("lightning.pytorch")
    check_release("lightning.pytorch")
    with pytest.raises(ValueError, match=rf"lightning {version('lightning')} needs torch .*has torch 1\.13\.1"):
        check_release("lightning.pytorch", torch_version="1.13.1")
