"""An image classifier on real images stored as bytes: scikit-learn's 8x8 handwritten digits.

The 1,797 digits ship inside scikit-learn (nothing is downloaded). Each image is stored in
the DataFrame as 64 raw bytes (a `binary` column), as images usually are; `inputCols`
hands them to the model as uint8 (they stay one byte per pixel in the tasks' memory and
spill files) and `inputShapes={"image": [1, 8, 8]}` gives each row its shape, so a small
CNN sees `(batch, 1, 8, 8)`. Prints the accuracy on held-out digits.

Needs the `examples` extra (`pip install spark-torch-est[examples]`). Runs with
`python examples/image_classifier.py` or `spark-submit examples/image_classifier.py`.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits
from torch import nn

from spark_torch_est import TorchEstimator

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


class SmallCNN(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),     # 16 x 4 x 4
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),    # 32 x 2 x 2
            nn.Flatten(), nn.Linear(128, 10),
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:  # uint8 (batch, 1, 8, 8), pixels 0..16
        return self.net(image.float() / 16.0)


def digits(spark: SparkSession):
    data = load_digits()
    images = data.images.astype(np.uint8)  # 0..16 per pixel
    rows = [(bytes(image.reshape(-1)), int(label), i % 5 == 0) for i, (image, label) in
            enumerate(zip(images, data.target))]
    return spark.createDataFrame(rows, "image binary, digit int, held_out boolean")


def main() -> None:
    # local[*] unless spark-submit --master or conf/spark-defaults.conf names another master
    spark = SparkSession.builder.appName("spark_torch_est image classifier").getOrCreate()
    df = digits(spark).cache()
    train, test = df.filter("NOT held_out"), df.filter("held_out")
    est = TorchEstimator(
        model=SmallCNN, optimizer=lambda model, config: torch.optim.Adam(model.parameters(), lr=config["lr"]),
        loss=nn.CrossEntropyLoss(), config={"lr": 0.005},
        inputCols=["image"], inputShapes={"image": [1, 8, 8]}, labelCol="digit",
        batchSize=32, maxEpochs=12, numWorkers=min(2, spark.sparkContext.defaultParallelism), seed=0,
        showProgress=False,
    )
    model = est.fit(train)
    print(f"epoch {est.history[-1]['epoch']}: train_loss {est.history[-1]['train_loss']:.4f}")
    scored = model.transform(test)
    accuracy = MulticlassClassificationEvaluator(labelCol="digit", metricName="accuracy").evaluate(scored)
    print(f"test accuracy {accuracy:.3f} on {test.count()} held-out digits (8x8 images stored as 64 bytes)")
    spark.stop()


if __name__ == "__main__":
    main()
