"""What the release before the move to folders by concept (3b72a3f) saved still works with
this code: its TorchModel and TorchEstimator load (their pickles name the old flat module
paths, e.g. ``spark_torch_est.builtin_hooks.EarlyStopping``), predict exactly what the old
code predicted, and continue their run where it stopped. The samples and the script that made
them are in tests/data/saved_3b72a3f/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spark_torch_est import CSVLogger, EarlyStopping, TorchEstimator, TorchModel

pytestmark = pytest.mark.spark

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "saved_3b72a3f"
PREDICTED = json.loads((SAMPLES / "predictions.json").read_text())


@pytest.fixture(scope="module")
def rows_df(spark):
    """The rows the samples were trained on, in the same two partitions as then (no shuffle:
    the order of rows a shuffle gives need not repeat)."""
    rows = json.loads((SAMPLES / "rows.json").read_text())
    return spark.createDataFrame(rows).select("id", "features", "label")


@pytest.fixture
def samples(tmp_path, monkeypatch) -> Path:
    """A copy of the samples (a fit writes checkpoints beside them), with the working
    directory in tmp_path (the pickled CSVLogger writes to its relative ``csv_logs``)."""
    shutil.copytree(SAMPLES, tmp_path / "samples", ignore=shutil.ignore_patterns("*.py"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "samples"


def _predictions(model: TorchModel, df) -> list[float]:
    return [r.prediction for r in model.transform(df).orderBy("id").select("prediction").collect()]


#: The same weights give the same predictions up to float32 rounding: the samples were made on
#: another CPU, whose matmul kernels round the last bit differently (seen: 2.4e-7 apart here).
SAME_WEIGHTS = {"rel": 1e-6, "abs": 1e-6}


def test_the_saved_model_and_estimator_load_and_predict_as_before(rows_df, samples):
    model = TorchModel.load(str(samples / "model"))
    assert _predictions(model, rows_df) == pytest.approx(PREDICTED["epoch2"], **SAME_WEIGHTS)
    assert [e["epoch"] for e in model.history] == [1, 2]

    est = TorchEstimator.load(str(samples / "estimator"))
    assert est.progress.epoch == 2 and est.getMaxEpochs() == 4
    assert isinstance(next(iter(est.hooks.values())), EarlyStopping)
    assert isinstance(est.loggers[0], CSVLogger)
    assert _predictions(est._model(est.checkpoint), rows_df) == pytest.approx(PREDICTED["epoch2"], **SAME_WEIGHTS)


def _continue(rows_df, samples, resume: str) -> TorchModel:
    est = TorchEstimator.load(str(samples / "estimator"))
    est.setCheckpointDir(str(samples / "continued"))
    if resume == "estimator":
        return est.fit(rows_df)
    source = TorchModel.load(str(samples / "model")) if resume == "model" else str(samples / "checkpoints")
    return est.reset().fit(rows_df, resume_from=source)


@pytest.mark.parametrize("resume", ["estimator", "model", "checkpointDir"])
def test_the_saved_run_continues_to_its_fourth_epoch(rows_df, samples, resume):
    saved = TorchModel.load(str(samples / "model")).history
    model = _continue(rows_df, samples, resume)
    assert [e["epoch"] for e in model.history] == [1, 2, 3, 4]
    assert model.history[:2] == saved
    assert model.history[3]["train_loss"] < saved[1]["train_loss"]
    assert _predictions(model, rows_df) == pytest.approx(PREDICTED["epoch4"], abs=0.25)  # labels spread ~2
    assert any(path.name.startswith("ckpt-") and "-ep000004-" in path.name
               for path in (samples / "continued").iterdir())


def test_the_saved_run_continues_the_same_from_the_estimator_the_model_and_its_checkpoints(rows_df, samples):
    """The third and fourth epochs follow this release's epoch order (the run's logical shards,
    docs/reliability.md), not 3b72a3f's, so they need not equal the old code's continuation
    (within 0.25 above); but the run goes on the same whichever saved thing it resumes from."""
    continued = {resume: _predictions(_continue(rows_df, samples, resume), rows_df)
                 for resume in ("estimator", "model", "checkpointDir")}
    assert continued["model"] == continued["estimator"] == continued["checkpointDir"]
