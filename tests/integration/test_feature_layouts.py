"""transform, evaluate and save/load-then-transform for every feature layout a model reads,
from rows in memory and from a Parquet table (which the tasks read themselves); the Spark
Connect side of the matrix is in test_connect.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_torch_est import TorchEstimator, TorchModel
from tests.helpers import FEATURE_LAYOUTS, layout_data, layout_frame, linear_model, sgd, tasks_read_files

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def models(spark):
    """An 8-feature model (trained on array<double>) and a 1-feature one (one numeric column)."""
    trained = {}
    for width in (8, 1):
        x, y = layout_data(width)
        df, params = layout_frame(spark, "array_double" if width == 8 else "numeric", x, y)
        est = TorchEstimator(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), config={"in_features": width},
                             maxEpochs=1, numWorkers=2, showProgress=False, **params)
        trained[width] = est.fit(df)
    return trained


@pytest.mark.parametrize("source", ["memory", "parquet"])
@pytest.mark.parametrize("layout", FEATURE_LAYOUTS)
def test_transform_evaluate_and_a_saved_model_for_each_layout(spark, models, layout, source, tmp_path):
    width = 1 if layout == "numeric" else 8
    x, y = layout_data(width)
    df, params = layout_frame(spark, layout, x, y)
    if source == "parquet":
        df.repartition(3).write.parquet(str(tmp_path / "table"))
        df = spark.read.parquet(str(tmp_path / "table"))
    model = models[width].copy({models[width].getParam(k): v for k, v in params.items()})
    expected = model.torch_model()(torch.tensor(x, dtype=torch.float32)).detach().numpy().ravel()

    scored = model.transform(df)
    assert scored.columns == df.columns + ["prediction"]
    assert tasks_read_files(scored) == (source == "parquet")
    assert scored.orderBy("id").drop("prediction").collect() == df.orderBy("id").collect()
    predicted = np.array([r.prediction for r in scored.orderBy("id").collect()])
    np.testing.assert_allclose(predicted, expected, rtol=1e-5, atol=1e-5)

    assert model.evaluate(df)["loss"] == pytest.approx(float(np.mean((expected - y) ** 2)), rel=1e-4)

    model.save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.getFeatureCols() == model.getFeatureCols() and loaded.getFeaturesCol() == model.getFeaturesCol()
    reloaded = np.array([r.prediction for r in loaded.transform(df).orderBy("id").collect()])
    np.testing.assert_array_equal(reloaded, predicted)
