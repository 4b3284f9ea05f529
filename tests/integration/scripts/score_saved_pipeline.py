"""Run by test_ml.py: load a saved PipelineModel in a fresh process and score rows."""

import json
import os
import sys

from pyspark.ml import PipelineModel
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

model_path, data_path = sys.argv[1], sys.argv[2]
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
scored = PipelineModel.load(model_path).transform(spark.read.parquet(data_path))
rows = scored.select("id", "prediction").orderBy("id").collect()
print("PREDICTIONS " + json.dumps([[r.id, r.prediction] for r in rows]))
spark.stop()
