"""A LightningModule fits unchanged: Lightning's own loop on every rank, checked against a
``pl.Trainer`` run of the same module on the same batches (docs/lightning.md)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra (pip install '.[lightning]')")

from spark_torch_est import TorchEstimator, TorchModel  # noqa: E402
from spark_torch_est.core.support import PREDICT_UDF, installed  # noqa: E402
from spark_torch_est.errors import InvalidInputError, TrainingFailedError  # noqa: E402
from spark_torch_est.loggers import CSVLogger, MLflowLogger  # noqa: E402
from tests.helpers import end_mlflow_download_threads, spark_jobs_started  # noqa: E402

pytestmark = [
    pytest.mark.spark, pytest.mark.compat,
]

ROWS, WIDTH, BATCH = 288, 4, 32  # every 9th row validates: 256 training rows, 4 steps per epoch on 2 ranks


class Regressor(pl.LightningModule):
    """A linear regression in Lightning's style: Adam with a StepLR dict, self.log with
    on_step/on_epoch/sync_dist, a validation_step; records the batches it trains on when
    ``record`` names a folder."""

    def __init__(self, lr: float = 0.05, record: str | None = None, scheduler: str = "step") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(WIDTH, 1)
        self.lr, self.record, self.scheduler = lr, record, scheduler
        self.seen_epochs: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).squeeze(-1), y)
        self.log("loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log_dict({"rank_seen": float(self.global_rank)}, on_step=False, on_epoch=True, sync_dist=True)
        if self.record is not None:
            name = f"e{self.current_epoch}-s{self.global_step}-r{self.global_rank}.pt"
            torch.save({"x": x, "y": y}, os.path.join(self.record, name))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", torch.nn.functional.mse_loss(self(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.scheduler == "none":
            return optimizer
        if self.scheduler == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "loss"}}
        step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": step, "interval": "step", "frequency": 2}}


@pytest.fixture(scope="module")
def lit_df(spark):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, WIDTH)).astype(np.float32)
    y = (x @ np.arange(1, WIDTH + 1, dtype=np.float32) + 0.25).astype(np.float32)
    rows = [(i, row.tolist(), float(t), i % 9 == 0) for i, (row, t) in enumerate(zip(x, y))]
    return spark.createDataFrame(rows, ["id", "features", "label", "is_val"])


def lit_estimator(module, **params) -> TorchEstimator:
    settings = dict(model=module, batchSize=BATCH, maxEpochs=3, numWorkers=2, showProgress=False,
                    validationIndicatorCol="is_val", trainerArgs={"num_sanity_val_steps": 0})
    return TorchEstimator(**{**settings, **params})


class _Batches:
    """The recorded global batches of each epoch, as a single-process Trainer's loader: the
    batches of ``module``'s current epoch, each step the two ranks' rows together."""

    def __init__(self, epochs: list[list[tuple[torch.Tensor, torch.Tensor]]], module: pl.LightningModule) -> None:
        self.epochs, self.module = epochs, module

    def __len__(self) -> int:
        return len(self.epochs[0])

    def __iter__(self):
        trainer = self.module._trainer
        epoch = trainer.current_epoch if trainer is not None else 0
        return iter(self.epochs[min(epoch, len(self.epochs) - 1)])


class _EpochLoss(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.values.append(float(trainer.callback_metrics["loss_epoch"]))


def recorded_epochs(folder: str) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The batches the ranks trained on, by epoch and step, both ranks' rows joined."""
    parts: dict[tuple[int, int], dict[int, dict]] = {}
    for name in os.listdir(folder):
        epoch, step, rank = (int(p[1:]) for p in name[:-3].split("-"))
        parts.setdefault((epoch, step), {})[rank] = torch.load(os.path.join(folder, name))
    epochs: dict[int, list] = {}
    for (epoch, _step), ranks in sorted(parts.items()):
        x = torch.cat([ranks[r]["x"] for r in sorted(ranks)])
        y = torch.cat([ranks[r]["y"] for r in sorted(ranks)])
        epochs.setdefault(epoch, []).append((x, y))
    return [epochs[e] for e in sorted(epochs)]


@pytest.mark.parametrize("scheduler", ["step", "plateau"])
def test_fit_matches_pl_trainer_on_the_same_batches(lit_df, tmp_path, scheduler):
    """Two ranks under the estimator and one process under pl.Trainer, on the same global
    batches: the same weights, the same epoch losses (close: DDP averages two half-batch
    gradients where one process takes the mean over the whole batch), the StepLR dict
    stepping every 2nd step, or ReduceLROnPlateau monitoring the logged loss, as in the
    Trainer; the logged values averaged over the ranks, validation on the indicator's rows."""
    record = tmp_path / "seen"
    record.mkdir()
    est = lit_estimator(Regressor(record=str(record), scheduler=scheduler))
    model = est.fit(lit_df)
    history = est.history
    assert [entry["epoch"] for entry in history] == [1, 2, 3]
    assert history[0]["rank_seen"] == pytest.approx(0.5)  # ranks 0 and 1, averaged (sync_dist)
    assert all(np.isfinite(entry["val_mse"]) for entry in history)
    assert "loss_step" not in history[0]

    epochs = recorded_epochs(str(record))
    assert [len(e) for e in epochs] == [4, 4, 4]
    rows = torch.cat([x for epoch in epochs for x, _ in epoch])
    assert len(rows) == 3 * 256 and len(torch.unique(rows[:256], dim=0)) == 256  # each row once per epoch

    reference, losses = Regressor(scheduler=scheduler), _EpochLoss()
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[losses])
    trainer.fit(reference, train_dataloaders=_Batches(epochs, reference))
    fitted = model.torch_model()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(fitted.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    assert [entry["loss"] for entry in history] == pytest.approx(losses.values, rel=1e-5)
    rates = [g["lr"] for g in trainer.optimizers[0].param_groups]
    if scheduler == "step":
        assert rates == pytest.approx([0.05 * 0.5 ** ((3 * 4 // 2) // 3)])
    fitted_rate = est.checkpoint.lightning_state["optimizer_states"][0]["param_groups"][0]["lr"]
    assert [fitted_rate] == pytest.approx(rates)
    if scheduler == "plateau":
        return

    predictions = np.array([r["prediction"] for r in model.transform(lit_df).orderBy("id").collect()])
    x = torch.tensor([r["features"] for r in lit_df.orderBy("id").collect()])
    with torch.no_grad():
        expected = fitted(x).squeeze(-1).numpy()
    np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-5)
    model.save(str(tmp_path / "saved"))
    loaded = TorchModel.load(str(tmp_path / "saved"))
    again = np.array([r["prediction"] for r in loaded.transform(lit_df).orderBy("id").collect()])
    np.testing.assert_array_equal(again, predictions)
    assert isinstance(loaded.torch_model(), Regressor)


def _weights(model) -> dict[str, torch.Tensor]:
    return model.torch_model().state_dict()


@pytest.fixture(scope="module")
def straight(lit_df):
    """One straight fit of the Regressor: its estimator and the fitted weights."""
    est = lit_estimator(Regressor())
    return est, _weights(est.fit(lit_df))


def test_fits_in_parts_equal_one_straight_fit(lit_df, straight):
    """fit(duration="2ep") then fit(), and fit(duration="5ba") (in the middle of epoch 2)
    then fit(), end where one straight fit does, bitwise on the CPU: Lightning's optimizer,
    scheduler (stepped every 2nd step) and loops continue from the package's checkpoint."""
    straight, expected = straight
    for duration in ("2ep", "5ba"):
        est = lit_estimator(Regressor())
        est.fit(lit_df, duration=duration)
        paused = est.checkpoint
        assert paused.lightning_state["optimizer_states"] and paused.lightning_state["lr_schedulers"]
        weights = _weights(est.fit(lit_df))
        assert all(torch.equal(weights[k], v) for k, v in expected.items()), duration
        assert [e["train_loss"] for e in est.history] == [e["train_loss"] for e in straight.history], duration
        assert est.checkpoint.lightning_state["global_step"] == straight.checkpoint.lightning_state["global_step"]
        assert est.history == straight.history, duration


class _StopOnRank1(pl.Callback):
    """Sets trainer.should_stop on rank 1 alone, at the end of epoch 2."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 1 and trainer.current_epoch == 1:
            trainer.should_stop = True


class _Counter(pl.Callback):
    """Counts the batches it saw, in its state."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]


def test_callbacks_act_as_under_the_trainer(lit_df, store, monkeypatch):
    """A callback setting should_stop on one rank stops every rank at that epoch's end;
    LearningRateMonitor's rates reach the history and the MLflow logger, which logs the fitted
    module; a callback's state is in the checkpoint."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    uri, client, experiment_id = store

    est = lit_estimator(Regressor(), maxEpochs=4, trainerArgs={"num_sanity_val_steps": 0, "log_every_n_steps": 1},
                        callbacks=[_StopOnRank1(), LearningRateMonitor(logging_interval="step"), _Counter()],
                        loggers=[MLflowLogger(tracking_uri=uri, experiment_name="tests")])
    model = est.fit(lit_df)
    assert [entry["epoch"] for entry in est.history] == [1, 2]
    # the rate at the start of each epoch's last batch: StepLR(step_size=3) stepped every 2nd batch
    assert est.history[0]["lr-Adam"] == pytest.approx(0.05)
    assert est.history[1]["lr-Adam"] == pytest.approx(0.05 * 0.5)
    assert est.checkpoint.lightning_state["callbacks"]["_Counter"] == {"batches": 8}
    (run,) = client.search_runs([experiment_id])
    assert {"lr-Adam", "loss", "val_mse", "train_loss"} <= set(run.data.metrics)
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    logged = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")  # the fitted module, by mlflow.pytorch
    x = torch.randn(5, WIDTH)
    with torch.no_grad():
        assert torch.allclose(logged(x), model.torch_model()(x))
    end_mlflow_download_threads()


def test_pytorch_lightning_module_with_early_stopping_and_bf16(lit_df):
    """A pytorch_lightning module fits too; its EarlyStopping stops the fit (every rank) when
    the monitored value gets no better; precision reaches the Trainer."""
    ptl = pytest.importorskip("pytorch_lightning")

    class PTLRegressor(ptl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(WIDTH, 1)

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x).squeeze(-1).float(), y)
            self.log("loss", loss, on_epoch=True, sync_dist=True)
            self.log("dtype_bf16", float(self(x).dtype == torch.bfloat16), on_epoch=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    stop = ptl.callbacks.EarlyStopping(monitor="loss", mode="max", patience=0)
    est = lit_estimator(PTLRegressor(), maxEpochs=5, validationIndicatorCol=None, precision="bf16-mixed",
                        callbacks=[stop])
    est.fit(lit_df)
    assert [entry["epoch"] for entry in est.history] == [1, 2]  # the loss fell in epoch 2: no better for "max"
    assert est.history[0]["dtype_bf16"] == 1.0


def test_refused_before_any_job(spark, lit_df):
    """optimizer= or loss= beside a LightningModule, hooks= in place of callbacks, and
    callbacks= with a plain module are refused on the driver before any Spark job."""
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match="configure_optimizers"):
        lit_estimator(Regressor(), optimizer=lambda model, config: torch.optim.SGD(model.parameters(), 0.1)).fit(
            lit_df)
    with pytest.raises(InvalidInputError, match="loss= is given with a LightningModule"):
        lit_estimator(lambda config: Regressor(), loss=torch.nn.MSELoss()).fit(lit_df)
    with pytest.raises(InvalidInputError, match="callbacks= are Lightning callbacks"):
        lit_estimator(lambda config: torch.nn.Linear(WIDTH, 1), optimizer=lambda m, c: torch.optim.SGD(
            m.parameters(), 0.1), loss=torch.nn.MSELoss(), callbacks=[_Counter()]).fit(lit_df)
    with pytest.raises(InvalidInputError, match="trainerArgs may not set 'max_epochs'"):
        lit_estimator(Regressor(), trainerArgs={"max_epochs": 5})
    assert spark_jobs_started(spark) == jobs


class _CrashOnce(pl.Callback):
    """Hard-exits rank 1's Python worker after the 2nd batch of epoch 2, the first time only."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.current_epoch == 1 and batch_idx == 1 and not os.path.exists(
                self.marker):
            open(self.marker, "w").close()
            os._exit(3)


def test_relaunch_after_a_crash_ends_as_a_straight_fit(lit_df, straight, tmp_path, spark):
    """A rank that dies mid-epoch is relaunched from the newest checkpoint in checkpointDir
    (Lightning's state in it) and the run ends bitwise where a straight fit does; the epoch
    metrics reach the driver's loggers; predict_udf (transform() below Spark 4.1) and
    torch_model() serve the module."""
    from pyspark.sql import functions as F

    straight_est, expected = straight
    est = lit_estimator(Regressor(), checkpointDir=str(tmp_path / "ckpt"), maxRetries=1,
                        callbacks=[_CrashOnce(str(tmp_path / "crashed"))], loggers=[CSVLogger(str(tmp_path / "csv"))])
    model = est.fit(lit_df)
    assert os.path.exists(tmp_path / "crashed")
    weights = _weights(model)
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    assert est.history == straight_est.history
    csv_dir = tmp_path / "csv" / os.listdir(tmp_path / "csv")[0]
    header = (csv_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"epoch", "train_loss", "loss", "val_mse"} <= set(header)

    frame = lit_df.orderBy("id").limit(8)
    with torch.no_grad():
        x = torch.tensor([r["features"] for r in frame.collect()])
        direct = model.torch_model()(x).squeeze(-1).numpy()
    if installed("pyspark") >= PREDICT_UDF.needs:
        served = [r["p"] for r in frame.select(model.predict_udf()(F.col("features")).alias("p")).collect()]
    else:  # Spark 4.0 has no arrow_udf: predict_udf() is refused before any job, transform() serves
        with pytest.raises(InvalidInputError, match=r"predict_udf\(\) needs pyspark >= 4.1"):
            model.predict_udf()
        served = [r["prediction"] for r in model.transform(frame).orderBy("id").collect()]
    np.testing.assert_allclose(served, direct, rtol=1e-5, atol=1e-5)


class TypedRegressor(pl.LightningModule):
    """Two typed input columns and a weight: the batch is ``(a, b, label, weight)``; the
    optimizers come as ``([optimizer], [scheduler])``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 3)
        self.layer = torch.nn.Linear(3 + WIDTH, 1)
        self.shapes: list[list[int]] = []

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.cat([self.embed(ids), x], dim=1))

    def training_step(self, batch, batch_idx):
        ids, x, y, weight = batch
        assert ids.dtype == torch.int64 and weight.shape == y.shape
        loss = (weight * (self(ids, x).squeeze(-1) - y) ** 2).sum() / weight.sum()
        self.log("weighted_mse", loss, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def test_typed_inputs_and_weights(spark, lit_df):
    """inputCols give the step ``(*inputs, label)``, weightCol adds the weight last; the
    ``([opts], [scheds])`` form steps per epoch."""
    from pyspark.sql import functions as F

    df = lit_df.select((F.col("id") % 10).alias("ids"), F.col("features").alias("x"), "label",
                       (F.col("id") % 3 + 1).cast("double").alias("w"))
    est = TorchEstimator(model=TypedRegressor(), inputCols=["ids", "x"], featuresCol=None, weightCol="w",
                         batchSize=BATCH, maxEpochs=2, numWorkers=2, showProgress=False)
    model = est.fit(df)
    assert [e["epoch"] for e in est.history] == [1, 2]
    assert est.history[1]["weighted_mse"] < est.history[0]["weighted_mse"]
    assert est.checkpoint.lightning_state["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.0025)
    rows = model.transform(df).orderBy("ids").limit(4).collect()
    assert all(np.isfinite(r["prediction"]) for r in rows)


class ManualRegressor(pl.LightningModule):
    """Manual optimization: self.optimizers(), self.lr_schedulers(), manual_backward; the
    step returns nothing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self(x).squeeze(-1), y)
        self.manual_backward(loss)
        optimizer.step()
        if self.trainer.is_last_batch:
            scheduler.step()
        self.log("manual_mse", loss, on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.02)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)]


def test_manual_optimization(lit_df):
    """self.optimizers() and self.lr_schedulers() under manual optimization; a step that
    returns no loss leaves train_loss out of the history, the logged values in."""
    est = lit_estimator(ManualRegressor(), maxEpochs=2, validationIndicatorCol=None)
    est.fit(lit_df)
    assert [sorted(e) for e in est.history] == [["epoch", "manual_mse", "world_size"]] * 2
    assert est.history[1]["manual_mse"] < est.history[0]["manual_mse"]
    assert est.checkpoint.lightning_state["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.0002)


class _Failing(Regressor):
    def training_step(self, batch, batch_idx):
        if self.current_epoch == 1 and batch_idx == 1:
            raise ValueError("boom in training_step")
        return super().training_step(batch, batch_idx)


def test_an_error_in_the_module_fails_the_fit_and_keeps_the_run(lit_df):
    """An exception in training_step fails the fit once (user code is not retried), named
    with the module's frame; the estimator's run stays where it was."""
    est = lit_estimator(_Failing(), maxRetries=2)
    est.fit(lit_df, duration="1ep")
    before = est.checkpoint
    with pytest.raises(TrainingFailedError, match="boom in training_step") as failed:
        est.fit(lit_df)
    assert "training_step" in str(failed.value)
    assert est.checkpoint is before and est.progress.epoch == 1


class _PlainRegressor(torch.nn.Module):
    """The Regressor's layer, initialised alike, for the package's own loop."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_a_short_last_step_trains_every_row_once_as_the_packages_own_loop_does(spark, lit_df):
    """33 training rows at a global batch of 8: the last step has one row, so one rank has
    none. Lightning's loop trains it as the package's own loop does (a rank's loss counts by
    its rows of the step, a rank without rows adds nothing), not on a NaN of an empty batch."""
    from tests.helpers import flat_weights

    rows = lit_df.where("NOT is_val").orderBy("id").limit(33).drop("is_val")
    settings = dict(batchSize=4, maxEpochs=2, numWorkers=2, showProgress=False)
    lit = TorchEstimator(model=Regressor(scheduler="none"), **settings).fit(rows)
    plain = TorchEstimator(model=lambda config: _PlainRegressor(),
                           optimizer=lambda model, config: torch.optim.Adam(model.parameters(), lr=0.05),
                           loss=torch.nn.MSELoss(), **settings).fit(rows)
    assert np.isfinite(flat_weights(lit)).all()
    np.testing.assert_allclose(flat_weights(lit), flat_weights(plain), rtol=1e-5, atol=1e-6)
    assert lit.history[-1]["train_loss"] == pytest.approx(plain.history[-1]["train_loss"], rel=1e-4)


class _Squashed(Regressor):
    """Scores through its own predict_step: the regression's output squashed into (0, 1)."""

    def predict_step(self, batch, batch_idx):
        return torch.sigmoid(self(batch))


class _Unvalidated(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_evaluate_is_pl_trainer_validate_and_transform_calls_predict_step(spark, lit_df, tmp_path):
    """evaluate() returns what pl.Trainer.validate returns for the same rows (validation_step's
    logged values, averaged over every row of every partition); transform and predict_udf call
    the module's own predict_step; a module without validation_step is refused before any job."""
    est = lit_estimator(_Squashed(), maxEpochs=1)
    model = est.fit(lit_df)
    fitted = model.torch_model()
    x = torch.tensor([r["features"] for r in lit_df.orderBy("id").collect()])
    y = torch.tensor([r["label"] for r in lit_df.orderBy("id").collect()], dtype=torch.float32)

    uneven = lit_df.repartition(3, "id")  # partitions of different sizes
    evaluated = model.evaluate(uneven)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    rows = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=50)
    (expected,) = trainer.validate(fitted, dataloaders=rows, verbose=False)
    assert set(evaluated) == set(expected) == {"val_mse"}
    assert evaluated["val_mse"] == pytest.approx(expected["val_mse"], rel=1e-5)
    weighted = model.evaluate(lit_df.where("id < 100"))["val_mse"]  # other rows, other values
    assert weighted != pytest.approx(evaluated["val_mse"], rel=1e-3)

    predictions = np.array([r["prediction"] for r in model.transform(lit_df).orderBy("id").collect()])
    with torch.no_grad():
        squashed = torch.sigmoid(fitted(x)).squeeze(-1).numpy()
    np.testing.assert_allclose(predictions, squashed, rtol=1e-5, atol=1e-6)
    assert ((predictions > 0) & (predictions < 1)).all()
    if installed("pyspark") >= PREDICT_UDF.needs:
        scored = lit_df.orderBy("id").select(model.predict_udf()("features").alias("p")).collect()
        np.testing.assert_allclose([r["p"] for r in scored], squashed, rtol=1e-5, atol=1e-6)

    plain = lit_estimator(_Unvalidated(), maxEpochs=1, validationIndicatorCol=None).fit(lit_df)
    jobs = spark_jobs_started(spark)
    with pytest.raises(InvalidInputError, match="validation_step, which _Unvalidated does not define"):
        plain.evaluate(lit_df)
    assert spark_jobs_started(spark) == jobs


def test_elastic_fewer_slots_and_other_worker_counts_between_fits(lit_df, tmp_path, caplog):
    """minWorkers: three ranks asked for, two slots free, the module trains on two ranks with
    the global batch of three, bitwise a two-rank fit of that batch. A run paused mid-epoch
    on two ranks (64 rows a step) continues on one (32 rows a step: the rest of the epoch in 4
    steps, Lightning's epoch end and validation after them) and then on two again, every row
    once per epoch."""
    import logging

    shrunk = lit_estimator(Regressor(), numWorkers=3, minWorkers=2)
    with caplog.at_level(logging.WARNING, logger="spark_torch_est"):
        on_two = _weights(shrunk.fit(lit_df))
    assert any("training on 2 ranks (minWorkers=2)" in r.getMessage() for r in caplog.records)
    assert [e["world_size"] for e in shrunk.history] == [2, 2, 2]
    two = lit_estimator(Regressor(), batchSize=BATCH * 3 // 2)
    assert all(torch.equal(value, on_two[k]) for k, value in _weights(two.fit(lit_df)).items())
    assert shrunk.history == two.history

    record = tmp_path / "seen"
    record.mkdir()
    est = lit_estimator(Regressor(record=str(record)))
    est.fit(lit_df, duration="2ba")
    est.setNumWorkers(1)
    est.fit(lit_df, duration="1ep")  # the rest of epoch 1
    assert est.progress.epoch == 1 and est.progress.global_step == 2 + 4
    est.fit(lit_df, duration="1ep")
    assert est.progress.global_step == 6 + 8
    est.setNumWorkers(2)
    est.fit(lit_df)
    assert est.progress.global_step == 14 + 4
    assert est.checkpoint.lightning_state["global_step"] == 18
    assert [e["world_size"] for e in est.history] == [1, 1, 2]
    assert all(np.isfinite(e["val_mse"]) for e in est.history)  # validated at every epoch's end
    assert est.history[-1]["train_loss"] < est.history[0]["train_loss"]
    for epoch in recorded_epochs(str(record)):
        rows = torch.cat([x for x, _ in epoch])
        assert len(rows) == 256 and len(torch.unique(rows, dim=0)) == 256  # each row once


def test_a_fit_that_goes_on_right_before_a_step_without_rows_for_a_rank_equals_a_straight_fit(lit_df):
    """9 training rows at 2 a rank on 2 ranks: the shards hold 5 and 4 rows, so one rank has no
    row in each epoch's third step. A fit that stops after 2 steps and goes on there trains as
    one straight fit does, bitwise (the stand-in row comes from the rank's own rows)."""
    rows = lit_df.where("NOT is_val").orderBy("id").limit(9).drop("is_val")
    settings = dict(batchSize=2, maxEpochs=2, numWorkers=2, showProgress=False)
    straight = TorchEstimator(model=Regressor(scheduler="none"), **settings)
    expected = _weights(straight.fit(rows))
    parts = TorchEstimator(model=Regressor(scheduler="none"), **settings)
    parts.fit(rows, duration="2ba")
    weights = _weights(parts.fit(rows))
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    assert parts.history == straight.history


def test_validation_rows_on_one_rank_are_dealt_out_so_that_every_rank_validates(spark, lit_df):
    """A time-like split: the validation rows all sit in the first of two partitions, read as
    they are, so one rank holds none. They are dealt out over the ranks, and validation_step's
    sync_dist collectives meet (a rank without a batch would skip the loop, the other wait for
    it until the timeout); fewer validation rows than ranks is a clear error."""
    from pyspark.sql import functions as F

    early = lit_df.withColumn("early", F.col("id") < 20).repartitionByRange(2, "id")
    est = lit_estimator(Regressor(scheduler="none"), validationIndicatorCol="early", maxEpochs=2, timeout=60)
    est.fit(early)
    assert [e["epoch"] for e in est.history] == [1, 2] and all(np.isfinite(e["val_mse"]) for e in est.history)
    one = lit_df.withColumn("early", F.col("id") < 1).repartitionByRange(2, "id")
    with pytest.raises(InvalidInputError, match="validationIndicatorCol marks 1 rows, fewer than the 2 ranks"):
        lit_estimator(Regressor(scheduler="none"), validationIndicatorCol="early", maxEpochs=1, timeout=60).fit(one)
