"""The examples run top to bottom (each in its own driver process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]
EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize("script, expected", [
    ("notebook.py", "reloaded: 8000 rows scored"),
    ("custom_training.py", "epoch  1: train_loss"),
    ("train_classifier.py", "best model: test AUC 0.9"),
    ("recommender.py", "test AUC 0.8"),
    ("text_classifier.py", "test accuracy 0.9"),
    ("image_classifier.py", "test accuracy 0.9"),
    ("tune.py", "epochs trained in all: 15 (every configuration to maxEpochs: 36)"),
    ("optuna_tune.py", "MLflow: 6 child runs of the study's run"),
    ("large_model.py", "the full model, gathered: 530177 parameters"),
    ("lightning_module.py", "epoch  1  mse"),
])
def test_example_runs(script, expected):
    result = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-4000:]
    assert expected in result.stdout
