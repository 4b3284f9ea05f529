"""Typed inputs end to end: every column type of the table keeps its type through fit
(uneven partitions, spill, validation, exact resume, relaunch), transform, evaluate,
save/load and a Pipeline; ragged arrays padded per batch; sample weights; labels."""

from __future__ import annotations

import decimal
import re

import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import SQLTransformer
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F
from pyspark.sql import types as T
from torch import nn

from spark_torch_est import Hook, TorchEstimator, TorchModel
from spark_torch_est.errors import InputDataError, InvalidInputError, TrainingFailedError
from tests.helpers import CrashOnce, flat_weights, linear_estimator, spark_jobs_started, tasks_read_files

pytestmark = pytest.mark.spark

ROWS = 1200
PADDING = -7
INPUTS = ["id_byte", "id_int", "id_long", "f_float", "f_double", "f_decimal", "flag", "arr_int", "arr_double", "vec",
          "nested", "img", "tokens"]
SCHEMA = T.StructType([
    T.StructField("id_byte", T.ByteType()), T.StructField("id_int", T.IntegerType()),
    T.StructField("id_long", T.LongType()), T.StructField("f_float", T.FloatType()),
    T.StructField("f_double", T.DoubleType()), T.StructField("f_decimal", T.DecimalType(10, 3)),
    T.StructField("flag", T.BooleanType()), T.StructField("arr_int", T.ArrayType(T.IntegerType())),
    T.StructField("arr_double", T.ArrayType(T.DoubleType())), T.StructField("vec", Vectors.dense([0.0]).__UDT__),
    T.StructField("nested", T.ArrayType(T.ArrayType(T.FloatType()))), T.StructField("img", T.BinaryType()),
    T.StructField("tokens", T.ArrayType(T.LongType())), T.StructField("label", T.DoubleType()),
    T.StructField("w", T.DoubleType()), T.StructField("is_val", T.BooleanType()),
])


def _rows(count: int = ROWS, seed: int = 0) -> list[tuple]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        id_long = 2 ** 24 + 2 ** 40 * (i % 3) + i  # parity is exact only in int64
        arr_double = rng.normal(size=4)
        vec = Vectors.dense(rng.normal(size=4)) if i % 2 else Vectors.sparse(4, {1: float(rng.normal())})
        img = bytes(rng.integers(0, 256, size=16, dtype=np.uint8))
        tokens = [int(t) for t in rng.integers(1, 20, size=i % 6)]
        f_double = float(rng.normal())
        label = float(id_long % 2) + 0.5 * f_double - 0.25 * float(arr_double[0]) + 0.1 * len(tokens)
        rows.append((i % 100, i * 7, id_long, float(rng.normal()), f_double, decimal.Decimal(f"{rng.normal():.3f}"),
                     bool(i % 3 == 0), [i % 5, 1, 2], arr_double.tolist(), vec,
                     rng.normal(size=(2, 3)).astype(np.float32).tolist(), img, tokens, label,
                     float(1 + i % 4), i % 10 == 0))
    return rows


class Wide(nn.Module):
    """Takes every column type and refuses the wrong dtype or shape."""

    def __init__(self) -> None:
        super().__init__()
        self.parity = nn.Embedding(2, 1)
        self.tokens = nn.Embedding(20, 1)
        self.dense = nn.Linear(40, 1)

    def forward(self, id_byte, id_int, id_long, f_float, f_double, f_decimal, flag, arr_int, arr_double, vec, nested,
                img, tokens):
        expected = [(id_byte, torch.int64, 1), (id_int, torch.int64, 1), (id_long, torch.int64, 1),
                    (f_float, torch.float32, 1), (f_double, torch.float32, 1), (f_decimal, torch.float32, 1),
                    (flag, torch.bool, 1), (arr_int, torch.int64, 2), (arr_double, torch.float32, 2),
                    (vec, torch.float32, 2), (nested, torch.float32, 3), (img, torch.uint8, 4),
                    (tokens, torch.int64, 2)]
        for i, (x, dtype, dims) in enumerate(expected):
            if x.dtype != dtype or x.dim() != dims:
                raise TypeError(f"input {INPUTS[i]}: {x.dtype} {list(x.shape)}, expected {dtype} with {dims} dims")
        if list(nested.shape[1:]) != [2, 3] or list(img.shape[1:]) != [1, 4, 4] or arr_int.shape[1] != 3:
            raise TypeError(f"shapes {list(nested.shape)} {list(img.shape)} {list(arr_int.shape)}")
        present = tokens != PADDING
        token_count = present.sum(1, keepdim=True).float()
        dense = torch.cat([f_float[:, None], f_double[:, None], f_decimal[:, None], flag[:, None].float(),
                           arr_int.float(), arr_double, vec, nested.flatten(1), img.float().flatten(1) / 255,
                           (id_byte % 7)[:, None].float(), (id_int % 5)[:, None].float(), token_count], 1)
        embedded = (self.tokens(tokens.clamp_min(0)) * present.unsqueeze(2)).sum(1)
        return self.parity(id_long % 2) + self.dense(dense) + 0.0 * embedded


def _adam(model, config):
    return torch.optim.Adam(model.parameters(), lr=config.get("lr", 0.03))


#: This module's estimator: tests.helpers.linear_estimator with these settings.
SETTINGS = dict(model=lambda c: Wide(), optimizer=_adam, inputCols=INPUTS, inputShapes={"img": [1, 4, 4]},
                paddingValue=PADDING, labelCol="label", seed=3)


@pytest.fixture(scope="module")
def typed_df(spark):
    """The table in two partitions: the first full, the second mostly filtered away, so the
    ranks must even out their rows (every column type moves between them)."""
    df = spark.createDataFrame(_rows(), SCHEMA)
    return df.filter((F.col("id_int") < 7 * ROWS // 2) | (F.col("id_int") % 70 == 0)).cache()


@pytest.mark.compat
def test_every_column_type_trains_transforms_and_evaluates(spark, typed_df):
    est = linear_estimator(SETTINGS, validationIndicatorCol="is_val", memoryBudgetMB=0.01,  # every input spills
                           maxEpochs=15)
    model = est.fit(typed_df)
    scored = model.transform(typed_df).select("label", "prediction").toPandas()
    rmse = float(np.sqrt(((scored["label"] - scored["prediction"]) ** 2).mean()))
    assert rmse < 0.2 * float(scored["label"].std()), rmse  # ids' parity learned: they stayed exact
    assert "val_loss" in est.history[-1]
    mse = float(((scored["label"] - scored["prediction"]) ** 2).mean())
    assert model.evaluate(typed_df)["loss"] == pytest.approx(mse, rel=1e-4)
    assert [c.name for c in model.checkpoint.input_schema.columns] == INPUTS
    assert model.checkpoint.input_row_shapes[INPUTS.index("img")] == (1, 4, 4)
    assert model.checkpoint.input_row_shapes[INPUTS.index("tokens")] is None  # padded per batch


def test_two_plus_two_epochs_equal_four_and_a_relaunch_changes_nothing(spark, typed_df, tmp_path):
    whole = linear_estimator(SETTINGS)
    whole.fit(typed_df)
    split = linear_estimator(SETTINGS)
    split.fit(typed_df, duration="2ep")
    split.fit(typed_df, duration="2ep")
    crashed = linear_estimator(SETTINGS, hooks=[CrashOnce(str(tmp_path / "crashed"), batch=2)],
                               checkpointDir=str(tmp_path / "ckpt"), maxRetries=1)
    crashed.fit(typed_df)
    assert (tmp_path / "crashed").exists()
    np.testing.assert_array_equal(flat_weights(whole), flat_weights(split))
    np.testing.assert_array_equal(flat_weights(whole), flat_weights(crashed))




class PaddingCheck(Hook):
    """Checks each batch's tokens: each row its tokens then padding, the longest row unpadded."""

    def __init__(self) -> None:
        self.batches = self.padded = self.wrong = 0

    def before_train_iter(self, inputs):
        tokens = inputs[INPUTS.index("tokens")]
        present = tokens != PADDING
        ordered = bool((present[:, :-1] | ~present[:, 1:]).all()) if tokens.shape[1] > 1 else True
        longest = tokens.shape[1] == 0 or bool(present[:, -1].any())
        self.batches += 1
        self.padded += int(bool((~present).any()))
        self.wrong += int(not (ordered and longest))

    def state_dict(self):
        return {"batches": self.batches, "padded": self.padded, "wrong": self.wrong}

    def load_state_dict(self, state):
        self.batches, self.padded, self.wrong = state["batches"], state["padded"], state["wrong"]


def test_ragged_arrays_are_padded_to_each_batchs_longest_row(spark, typed_df):
    est = linear_estimator(SETTINGS, maxEpochs=1, hooks={"check": PaddingCheck()})
    est.fit(typed_df)
    state = est.hooks["check"].state_dict()
    assert state["batches"] > 5 and state["padded"] > 0 and state["wrong"] == 0


@pytest.mark.compat
def test_save_load_and_a_pipeline_keep_the_typed_model(spark, typed_df, tmp_path):
    pipeline = Pipeline(stages=[SQLTransformer(statement="SELECT *, f_double * 2 AS unused FROM __THIS__"),
                                linear_estimator(SETTINGS, maxEpochs=1)])
    fitted = pipeline.fit(typed_df)
    fitted.write().overwrite().save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    before = fitted.transform(typed_df).select("prediction").toPandas()["prediction"]
    after = loaded.transform(typed_df).select("prediction").toPandas()["prediction"]
    np.testing.assert_allclose(before, after, rtol=1e-6)
    model = fitted.stages[-1]
    model.save(str(tmp_path / "model"))
    assert TorchModel.load(str(tmp_path / "model")).getInputCols() == INPUTS


@pytest.mark.compat
def test_weighted_losses_are_exact_weighted_means_over_all_ranks(spark, typed_df):
    est = linear_estimator(SETTINGS, weightCol="w", validationIndicatorCol="is_val", maxEpochs=2)
    model = est.fit(typed_df)
    scored = model.transform(typed_df).select("label", "prediction", "w", "is_val").toPandas()
    errors = (scored["label"] - scored["prediction"]) ** 2
    val = scored["is_val"]
    expected_val = float((errors[val] * scored["w"][val]).sum() / scored["w"][val].sum())
    assert est.history[-1]["val_loss"] == pytest.approx(expected_val, rel=1e-4)
    expected_all = float((errors * scored["w"]).sum() / scored["w"].sum())
    assert model.evaluate(typed_df)["loss"] == pytest.approx(expected_all, rel=1e-4)
    unweighted = float(errors.mean())
    assert abs(expected_all - unweighted) > 1e-6 * unweighted  # the weights did change the figure


def _logistic(config):
    return nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())


def test_horovod_sample_weight_col_with_a_functional_loss_is_called_per_row(spark):
    """Horovod's ``sample_weight_col`` calls a ``torch.nn.functional`` loss with
    ``reduction="none"``; so does weightCol."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(600, 4))
    y = (x @ np.array([1.0, -1.0, 0.5, 2.0]) + rng.normal(scale=0.5, size=600) > 0).astype(float)
    w = np.where(y > 0, 4.0, 0.25)  # positives count 16 times as much as negatives
    df = spark.createDataFrame([(r.tolist(), float(t), float(v)) for r, t, v in zip(x, y, w)],
                               ["features", "label", "w"]).cache()
    settings = dict(model=_logistic, optimizer=_adam, loss=torch.nn.functional.binary_cross_entropy,
                    config={"lr": 0.05}, maxEpochs=1, numWorkers=2, seed=2, showProgress=False)
    for batch in (1, 7):
        TorchEstimator(weightCol="w", batchSize=batch, **settings).fit(df.limit(28))
    weighted = TorchEstimator(weightCol="w", batchSize=16, **settings).fit(df)
    plain = TorchEstimator(batchSize=16, **settings).fit(df)
    assert not np.array_equal(flat_weights(weighted), flat_weights(plain))
    scored = weighted.transform(df).select("label", "prediction", "w").toPandas()
    p = scored["prediction"].clip(1e-7, 1 - 1e-7)
    bce = -(scored["label"] * np.log(p) + (1 - scored["label"]) * np.log(1 - p))
    assert weighted.evaluate(df)["loss"] == pytest.approx(float((bce * scored["w"]).sum() / scored["w"].sum()),
                                                          rel=1e-4)
    assert (scored["prediction"] > 0.5).mean() > (plain.transform(df).toPandas()["prediction"] > 0.5).mean()
    df.unpersist()


def test_horovod_weights_as_a_second_label_column_reach_a_callable_loss_as_the_column_holds_them(spark):
    """Horovod users pass ``[target, weight]`` as the label of a callable loss: it is the
    loss's business, whatever its width; a loss module keeps refusing such a label."""
    rng = np.random.default_rng(9)
    x = rng.normal(size=(400, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0])
    rows = [(r.tolist(), [float(t), 1.0 + (i % 2)], i % 5 == 0) for i, (r, t) in enumerate(zip(x, y))]
    df = spark.createDataFrame(rows, ["features", "pair", "is_val"]).cache()

    def weighted_mse(outputs, labels):  # labels: (B, 2), as the column holds them
        return ((outputs[:, 0] - labels[:, 0]) ** 2 * labels[:, 1]).sum() / labels[:, 1].sum()

    settings = dict(model=lambda c: nn.Linear(4, 1), optimizer=_adam, labelCol="pair", validationIndicatorCol="is_val",
                    config={"lr": 0.1}, batchSize=32, maxEpochs=3, numWorkers=2, seed=1, showProgress=False)
    est = TorchEstimator(loss=weighted_mse, **settings)
    model = est.fit(df)
    assert est.history[-1]["train_loss"] < est.history[0]["train_loss"] / 2
    assert est.history[-1]["val_loss"] == pytest.approx(model.evaluate(df.filter("is_val"))["loss"], rel=1e-5)
    with pytest.raises(InputDataError, match=r"the model returns \[1\] values per row but labelCol 'pair' "
                                                  r"holds 2 values per row"):
        TorchEstimator(loss=nn.MSELoss(), **settings).fit(df)
    df.unpersist()


def test_a_loss_module_that_sums_is_refused_with_weights_before_any_job(spark, typed_df):
    est = linear_estimator(SETTINGS, weightCol="w", loss=nn.MSELoss(reduction="sum"), maxEpochs=1)
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match=r"MSELoss has reduction='sum'; use reduction='mean'.*"
                                                r"weightCol='w'"):
        est.fit(typed_df)
    assert spark_jobs_started(spark) == jobs and est.checkpoint is None


def test_a_callable_loss_without_per_row_values_is_refused_with_the_fix(spark, typed_df):
    est = linear_estimator(SETTINGS, weightCol="w", loss=lambda outputs, labels: ((outputs - labels) ** 2).mean(),
                           maxEpochs=1)
    with pytest.raises(TrainingFailedError, match=r"the loss \(function .*<lambda>\) returned a Tensor of shape "
                       r"\[\]; expected one value per row with weightCol.*a loss module or a function with a "
                       r"reduction keyword") as raised:
        est.fit(typed_df)
    assert "a bug in spark_torch_est" not in str(raised.value) and not raised.value.retryable
    assert est.checkpoint is None


def test_integer_labels_of_a_one_output_model_train_as_regression(spark):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2000, 4))
    y = np.rint(x @ np.array([3.0, -2.0, 1.0, 4.0]) + 10).astype(int)
    ints = spark.createDataFrame([(r.tolist(), int(t)) for r, t in zip(x, y)], ["features", "label"])
    models = [TorchEstimator(model=lambda c: nn.Linear(4, 1), optimizer=_adam, loss=nn.MSELoss(), batchSize=32,
                             maxEpochs=5, config={"lr": 0.1}, showProgress=False).fit(df)
              for df in (ints, ints.withColumn("label", F.col("label").cast("double")))]
    for key, value in models[0].checkpoint.model_state.items():  # the same training as for the same doubles
        assert torch.equal(value, models[1].checkpoint.model_state[key]), key
    scored = models[0].transform(ints).select("label", "prediction").toPandas()
    assert float(((scored["label"] - scored["prediction"]) ** 2).mean()) < 1.0  # not 71: nothing broadcast
    assert models[0].checkpoint.label_kind == "float"


@pytest.mark.parametrize("change, message", [
    (lambda df: df.withColumn("name", F.lit("x")), "column 'name' has type string.*StringIndexer"),
    (lambda df: df, "inputShapes\\['f_double'\\]=\\[2\\] needs 2 values per row.*has 1"),
])
def test_bad_typed_inputs_fail_on_the_driver_before_any_job(spark, typed_df, change, message):
    inputs = INPUTS + ["name"] if "string" in message else INPUTS
    shapes = {"img": [1, 4, 4], "f_double": [2]} if "f_double" in message else {"img": [1, 4, 4]}
    est = linear_estimator(SETTINGS, inputCols=inputs, inputShapes=shapes)
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match=message):
        est.fit(change(typed_df))
    assert spark_jobs_started(spark) == jobs


def test_a_shape_the_rows_do_not_fill_fails_at_ingest_naming_the_column(spark, typed_df):
    with pytest.raises(InvalidInputError, match="inputShapes\\['img'\\]=\\[1, 3, 3\\] needs 9 values.*'img'.*16"):
        linear_estimator(SETTINGS, inputShapes={"img": [1, 3, 3]}, maxEpochs=1).fit(typed_df)


def test_transform_names_a_missing_or_retyped_column_before_any_job(spark, typed_df):
    model = linear_estimator(SETTINGS, maxEpochs=1).fit(typed_df)
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match="inputCols=.*'tokens': no such column"):
        model.transform(typed_df.drop("tokens"))
    with pytest.raises(InvalidInputError, match="column 'id_long' has type double, but the model was trained on "
                                                "bigint"):
        model.evaluate(typed_df.withColumn("id_long", F.col("id_long").cast("double")))
    assert spark_jobs_started(spark) == jobs


def test_a_ragged_features_column_names_the_users_column(spark):
    df = spark.createDataFrame([([1.0, 2.0], 1.0), ([1.0], 2.0)] * 10, ["data", "label"])
    est = TorchEstimator(model=lambda c: nn.Linear(2, 1), optimizer=_adam, loss=nn.MSELoss(), featuresCol="data",
                         maxEpochs=1, showProgress=False)
    with pytest.raises(InvalidInputError, match="'data' holds arrays of different lengths"):
        est.fit(df)


def test_a_classifier_on_int_labels_of_any_width_evaluates(spark):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(600, 4))
    labels = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0).astype(int)  # 0, 1 or 2
    df = spark.createDataFrame([(r.tolist(), int(t)) for r, t in zip(x, labels)], "features array<double>, label int")
    model = TorchEstimator(model=lambda c: nn.Linear(4, 3), optimizer=_adam, loss=nn.CrossEntropyLoss(),
                           maxEpochs=3, showProgress=False).fit(df)
    for label_type in ("tinyint", "smallint", "int", "bigint"):
        typed = df.withColumn("label", F.col("label").cast(label_type))
        assert model.evaluate(typed)["loss"] == pytest.approx(model.evaluate(df)["loss"], rel=1e-6)


@pytest.mark.compat
def test_a_parquet_table_is_scored_from_its_files_exactly_as_through_spark(spark, tmp_path):
    """Every type pyarrow reads as Spark passes it (ids > 2^24, Vectors, nested and ragged
    arrays, bytes, strings): transform and evaluate read the files; other types go through Spark."""
    df = (spark.createDataFrame(_rows(), SCHEMA).withColumn("f_decimal", F.col("f_decimal").cast("double"))
          .withColumn("name", F.concat(F.lit("row "), F.col("id_int").cast("string"))))
    df.repartition(3).write.parquet(str(tmp_path / "table"))
    table = spark.read.parquet(str(tmp_path / "table"))
    model = linear_estimator(SETTINGS, maxEpochs=1).fit(table)
    spark_read = model.copy({model.directRead: False})
    direct, through_spark = model.transform(table), spark_read.transform(table)
    assert tasks_read_files(direct) and not tasks_read_files(through_spark)
    rows, expected = direct.orderBy("id_int").toPandas(), through_spark.orderBy("id_int").toPandas()
    assert len(rows) == ROWS and rows.drop(columns="prediction").equals(expected.drop(columns="prediction"))
    np.testing.assert_allclose(rows["prediction"], expected["prediction"], rtol=1e-6, atol=1e-6)
    assert model.evaluate(table) == pytest.approx(spark_read.evaluate(table), rel=1e-6)

    table.withColumn("day", F.to_date(F.lit("2026-12-01"))).write.parquet(str(tmp_path / "dated"))
    dated = spark.read.parquet(str(tmp_path / "dated"))
    assert not tasks_read_files(model.transform(dated)), "a date column: Spark's reader decides its values"
    assert tasks_read_files(model.transform(dated.drop("day")))
    assert model.evaluate(dated) == pytest.approx(spark_read.evaluate(table), rel=1e-6)  # only its columns count


@pytest.mark.parametrize("padding", [0.5, float("nan"), 1e30])
def test_a_padding_value_integer_arrays_cannot_hold_is_refused_before_any_job(spark, typed_df, padding):
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError,
                       match=f"paddingValue={re.escape(repr(padding))} cannot pad the int64 arrays of inputCols "
                             "column 'arr_int' \\(array<int>\\): set a whole number"):
        linear_estimator(SETTINGS, paddingValue=padding).fit(typed_df)
    assert spark_jobs_started(spark) == jobs


class SmallEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 1)

    def forward(self, id_byte):
        return self.table(id_byte)


def test_an_id_past_an_embedding_names_the_inputs_and_their_ids(spark, typed_df):
    est = linear_estimator(SETTINGS, model=lambda c: SmallEmbedding(), inputCols=["id_byte"], inputShapes=None,
                           maxEpochs=1)
    with pytest.raises(TrainingFailedError, match=(
            "index out of range in self: an id is out of an embedding's range; in this batch 'id_byte' holds "
            "\\d+\\.\\.\\d+ \\(an nn.Embedding of n rows takes ids 0\\.\\.n-1\\); the model was called as "
            "model\\(\\*inputs\\) with inputCols 'id_byte': int64")):
        est.fit(typed_df)
    assert est.checkpoint is None
