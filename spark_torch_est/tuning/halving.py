"""[driver] Successive halving on exact resume: tuning in which a kept configuration goes
on from where it stopped and is never trained again from scratch.

Rung 0 trains every param map for ``minDuration`` epochs; the ``ceil(n / eta)`` best by the
evaluator continue their own runs (``fit(df, duration=...)``) to ``eta`` times the epochs
of the rung before, capped at their ``maxEpochs``, until one is left, which then trains to
its ``maxEpochs``. Since runs resume exactly, the winner's model is the one a straight fit
of its param map gives (bitwise on CPU with a fixed seed).

For Optuna, :class:`~spark_torch_est.tuning.optuna.OptunaPruning` (a driver-side logger) reports each epoch's metric to
a trial and stops a fit its pruner prunes, at an epoch end (see docs/tuning.md).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pyspark import inheritable_thread_target, keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.evaluation import (
    BinaryClassificationEvaluator,
    Evaluator,
    MulticlassClassificationEvaluator,
    RegressionEvaluator,
)
from pyspark.ml.param.shared import HasParallelism, HasSeed
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_torch_est.cluster.launcher import wait_for_slots
from spark_torch_est.core.duration import Duration
from spark_torch_est.core.jvm import task_slots
from spark_torch_est.errors import InvalidInputError, TrainingFailedError
from spark_torch_est.estimator import TorchEstimator
from spark_torch_est.ingest.frames import label_kind
from spark_torch_est.model import TorchModel
from spark_torch_est.params.base import param_map_name
from spark_torch_est.persistence import TorchPersistence, read_required
from spark_torch_est.planning import check_params
from spark_torch_est.tuning.halving_params import HalvingParams

__all__ = ["SuccessiveHalving", "SuccessiveHalvingModel", "param_map_name"]

logger = logging.getLogger(__name__)

#: Output Params of a TorchModel whose columns only classifiers (one number per label row) write.
_CLASSIFIER_OUTPUTS = ("rawPredictionCol", "probabilityCol")


class _SuccessiveHalvingParams(HalvingParams, HasSeed, HasParallelism):
    """Params of SuccessiveHalving: the table's (:mod:`spark_torch_est.tuning.halving_params`) and
    pyspark's shared seed and parallelism."""


@dataclass(eq=False)
class _Trial:
    """One param map's run through the rungs."""

    index: int
    estimator: TorchEstimator
    model: TorchModel | None = None
    metric: float | None = None
    stalled: bool = False  # its last fit trained no epoch (a hook stopped it): it goes no further
    error: str | None = None  # ``Type: message`` of the fit or evaluation that failed: it goes no further

    @property
    def epochs(self) -> int:
        return self.estimator.progress.epoch

    @property
    def max_epochs(self) -> int:
        return self.estimator.getMaxEpochs()

    @property
    def finished(self) -> bool:
        return self.stalled or self.epochs >= self.max_epochs

    def last_metric(self) -> float:
        """Its metric at the last rung it reached (NaN once it failed); every map has one
        from rung 0 on."""
        if self.metric is None:
            raise RuntimeError(f"param map {self.index} has not been evaluated yet")
        return self.metric


class SuccessiveHalving(Estimator, _SuccessiveHalvingParams):
    """Tunes a :class:`TorchEstimator` over param maps by successive halving, continuing
    the runs of the configurations it keeps (see docs/tuning.md).

    Args:
        estimator: The TorchEstimator; each param map trains a copy (a new run), the
            estimator's own run is left alone.
        estimatorParamMaps: Param maps, e.g. from ``ParamGridBuilder`` (``config`` included).
        evaluator: A Spark ML Evaluator scoring ``model.transform(validation rows)``.
        eta: Each rung keeps the best ``ceil(n / eta)`` and trains them to ``eta`` times the
            epochs of the rung before (default 2; at least 2).
        minDuration: Epochs every configuration trains in rung 0 (default ``"1ep"``).
        parallelism: Configurations trained at once, each a barrier job of its
            ``numWorkers`` ranks (default 1); results do not depend on it.
        seed: Seed of the ``trainRatio`` split (default: pyspark's per-class default).
        trainRatio: Fraction of the rows to train on when the estimator has no
            ``validationIndicatorCol`` (default 0.75); the rest are the validation rows.
    """

    _input_kwargs: dict[str, Any]  # the constructor's arguments, as @keyword_only records them

    @keyword_only
    def __init__(self, *, estimator: TorchEstimator | None = None, estimatorParamMaps: Sequence[dict] | None = None,
                 evaluator: Evaluator | None = None, eta: int = 2, minDuration: str = "1ep", parallelism: int = 1,
                 seed: int | None = None, trainRatio: float = 0.75) -> None:
        super().__init__()
        self._setDefault(parallelism=1)
        self._set(**self._input_kwargs)

    def setParallelism(self, value: int) -> SuccessiveHalving:
        """Sets parallelism."""
        return self._set(parallelism=value)

    def setSeed(self, value: int) -> SuccessiveHalving:
        """Sets seed."""
        return self._set(seed=value)

    def _fit(self, dataset: DataFrame) -> SuccessiveHalvingModel:
        trials, min_epochs = self._checked_trials(dataset)
        evaluator = self.getEvaluator()
        with self._split(dataset, trials[0].estimator) as (train, validation), _tuner_run(self, trials):
            def advance(trial: _Trial, epochs: int) -> None:
                before = trial.epochs
                try:
                    model = trial.estimator.fit(train, duration=f"{epochs - before}ep")
                    trial.metric = float(evaluator.evaluate(model.transform(validation)))
                except Exception as error:  # one bad configuration costs no other its work
                    trial.error, trial.metric = f"{type(error).__name__}: {error}"[:2000], math.nan
                    logger.warning("successive halving: param map %d (%s) failed and leaves the search: %s",
                                   trial.index, param_map_name(self.getEstimatorParamMaps()[trial.index]),
                                   trial.error)
                    return
                trial.model, trial.stalled = model, trial.epochs == before

            winner, rungs = self._rungs(trials, min_epochs, evaluator.isLargerBetter(), _runner(self, dataset, advance))
        logger.info("successive halving chose map %d (%s) with %s", winner.index,
                    param_map_name(self.getEstimatorParamMaps()[winner.index]), winner.metric)
        return SuccessiveHalvingModel(bestModel=winner.model, validationMetrics=[t.last_metric() for t in trials],
                                      rungs=rungs)

    def _rungs(self, trials: list[_Trial], min_epochs: int, larger_is_better: bool,
               advance_all: Callable[[list[tuple[_Trial, int]]], None]) -> tuple[_Trial, list[dict]]:
        """Runs the rungs; returns the winner and every decision, in rung then map order.
        A map whose fit or evaluation fails is recorded (its entry carries ``"error"``), ranked
        last and never kept; when every map still in the search failed, the best map of an
        earlier rung wins.

        Raises:
            TrainingFailedError: Every map failed; names each map's error.
        """
        alive, epochs, rung, rungs = list(trials), min_epochs, 0, []
        while True:
            goals = [(t, min(epochs, t.max_epochs)) for t in alive]
            advance_all([(t, goal) for t, goal in goals if t.metric is None or (t.epochs < goal and not t.stalled)])
            working = [t for t in alive if t.error is None]
            capped = all(t.finished for t in working)
            ranked = sorted(working, key=lambda t: _rank_key(t, larger_is_better))
            kept = ranked[:1 if capped else math.ceil(len(alive) / self.getEta())]
            for trial in alive:
                entry = {"rung": rung, "index": trial.index, "epochs": trial.epochs, "metric": trial.metric,
                         "kept": trial in kept}
                rungs.append(entry if trial.error is None else {**entry, "error": trial.error})
            logger.info("rung %d: %s; kept %s", rung, ", ".join(
                f"map {t.index}: {'failed' if t.error else f'{t.metric:.6g}'}" for t in alive), [t.index for t in kept])
            if not kept:
                return self._best_of_the_rest(trials, larger_is_better), rungs
            if len(kept) == 1 and kept[0].finished:
                return kept[0], rungs
            alive = sorted(kept, key=lambda t: t.index)
            epochs = alive[0].max_epochs if len(alive) == 1 else epochs * self.getEta()
            rung += 1

    def _best_of_the_rest(self, trials: list[_Trial], larger_is_better: bool) -> _Trial:
        """The best map that did not fail, at the last rung it reached.

        Raises:
            TrainingFailedError: Every map failed; names each map's error.
        """
        rest = [t for t in trials if t.error is None and t.model is not None]
        if rest:
            return min(rest, key=lambda t: _rank_key(t, larger_is_better))
        maps = self.getEstimatorParamMaps()
        raise TrainingFailedError("successive halving: every param map failed: " + "; ".join(
            f"map {t.index} ({param_map_name(maps[t.index])}): {t.error}" for t in trials))

    # ----------------------------------------------------------------- validation

    def _checked_trials(self, dataset: DataFrame) -> tuple[list[_Trial], int]:
        """Checks every setting on the driver, before any Spark job; returns one trial per
        param map (a copy of the estimator: a new run) and rung 0's epochs."""
        estimator, maps = (self.getOrDefault(p) if self.isDefined(p) else None
                           for p in (self.estimator, self.estimatorParamMaps))
        if not isinstance(estimator, TorchEstimator):
            raise InvalidInputError(f"SuccessiveHalving needs estimator=TorchEstimator(...), got "
                                    f"{type(estimator).__name__}")
        if not isinstance(maps, (list, tuple)) or not maps or not all(isinstance(m, dict) for m in maps):
            raise InvalidInputError(f"estimatorParamMaps must be a non-empty list of param maps (e.g. "
                                    f"ParamGridBuilder().build()), got {maps!r}"[:500])
        if self.getEta() < 2:
            raise InvalidInputError(f"eta must be at least 2 (each rung keeps ceil(n / eta) configurations), "
                                    f"got {self.getEta()}")
        if self.getParallelism() < 1:
            raise InvalidInputError(f"parallelism must be at least 1, got {self.getParallelism()}")
        min_epochs = _epochs(self.getMinDuration())
        trials = [_Trial(i, estimator.copy(dict(m))) for i, m in enumerate(maps)]
        for trial in trials:
            check_params(trial.estimator)
            if min_epochs > trial.max_epochs:
                raise InvalidInputError(
                    f"minDuration={self.getMinDuration()!r} is past maxEpochs={trial.max_epochs} of param map "
                    f"{trial.index} ({param_map_name(maps[trial.index])}): lower minDuration or raise maxEpochs")
            _check_evaluator(self.getEvaluator() if self.isDefined(self.evaluator) else None, trial.estimator,
                             dataset)
        if not trials[0].estimator.getValidationIndicatorCol() and not 0 < self.getTrainRatio() < 1:
            raise InvalidInputError(f"trainRatio must be between 0 and 1 (the rest are the validation rows), "
                                    f"got {self.getTrainRatio()}")
        self._check_slots(dataset, trials)
        return trials, min_epochs

    def _check_slots(self, dataset: DataFrame, trials: list[_Trial]) -> None:
        """``parallelism`` configurations train at once, each with its numWorkers ranks: the
        cluster must offer that many task slots together (else Spark would queue them)."""
        parallel = min(self.getParallelism(), len(trials))
        widths = sorted((t.estimator.getNumWorkers() for t in trials), reverse=True)[:parallel]
        if parallel == 1 or task_slots(dataset.sparkSession) is None:
            return
        spark = dataset.sparkSession
        try:
            wait_for_slots(spark, sum(widths), trials[0].estimator.getSlotWaitTimeout())
        except InvalidInputError:
            raise InvalidInputError(
                f"parallelism={parallel} trains {parallel} configurations at once with numWorkers "
                f"{' + '.join(map(str, widths))} = {sum(widths)} ranks, but the cluster offers {task_slots(spark)} "
                f"task slots (master={spark.sparkContext.getConf().get('spark.master', '?')}): lower parallelism or "
                "numWorkers") from None

    @contextmanager
    def _split(self, dataset: DataFrame, estimator: TorchEstimator) -> Iterator[tuple[DataFrame, DataFrame]]:
        """The training and validation rows, made once for every rung: the estimator's
        validationIndicatorCol (it trains on the rest itself), else a seeded trainRatio
        split, cached while the tuner runs."""
        indicator = estimator.getValidationIndicatorCol()
        if indicator:
            yield dataset, dataset.filter(F.col(indicator))
            return
        column = f"{self.uid}_rand"
        scored = dataset.select("*", F.rand(self.getOrDefault(self.seed)).alias(column))
        train = scored.filter(F.col(column) < self.getTrainRatio()).drop(column).cache()
        validation = scored.filter(F.col(column) >= self.getTrainRatio()).drop(column).cache()
        try:
            yield train, validation
        finally:
            train.unpersist()
            validation.unpersist()


def _rank_key(trial: _Trial, larger_is_better: bool) -> tuple[bool, float, int]:
    """Best first; a NaN metric last; ties by map order."""
    metric = trial.last_metric()
    return math.isnan(metric), -metric if larger_is_better else metric, trial.index


def _epochs(text: str) -> int:
    duration = Duration.parse(text, what="minDuration")
    if duration.unit != "ep":
        raise InvalidInputError(f"minDuration counts epochs (e.g. '1ep'), got {text!r}")
    return duration.value


def _runner(tuner: SuccessiveHalving, dataset: DataFrame,
            advance: Callable[[_Trial, int], None]) -> Callable[[list[tuple[_Trial, int]]], None]:
    """Runs ``advance`` over a rung's trials, ``parallelism`` at a time; the first error in
    map order is raised once all have ended."""
    def run_all(work: list[tuple[_Trial, int]]) -> None:
        parallel = min(tuner.getParallelism(), len(work))
        if parallel <= 1:
            for trial, epochs in work:
                advance(trial, epochs)
            return
        task = inheritable_thread_target(dataset.sparkSession)(lambda item: advance(*item))
        with ThreadPoolExecutor(parallel, thread_name_prefix="spark_torch_est-tuning") as pool:
            futures = [pool.submit(task, item) for item in work]
        for future in futures:
            future.result()

    return run_all


def _check_evaluator(evaluator: Any, estimator: TorchEstimator, dataset: DataFrame) -> None:
    """Refuses an evaluator that reads a column the model will not write (as the evaluator
    needs it), or a label column that is not in the data."""
    if not isinstance(evaluator, Evaluator):
        raise InvalidInputError(f"evaluator must be a pyspark.ml.evaluation.Evaluator, got {type(evaluator).__name__}")
    name = type(evaluator).__name__
    if evaluator.hasParam("labelCol") and evaluator.getOrDefault("labelCol") not in dataset.columns:
        raise InvalidInputError(f"evaluator={name} reads labelCol={evaluator.getOrDefault('labelCol')!r}, which the "
                                f"DataFrame does not have (its columns: {dataset.columns}); set the evaluator's "
                                "labelCol")
    several = label_kind(dataset.schema, estimator.getLabelCol()) not in ("long", "float")
    for param in _read_outputs(evaluator):
        wanted, written = evaluator.getOrDefault(param), estimator.getOrDefault(param)
        if wanted != written or not written:
            raise InvalidInputError(
                f"evaluator={name} reads {param}={wanted!r}, but the model writes "
                f"{f'{param}={written!r}' if written else f'no {param} ({param} is empty)'}: set the same {param} on "
                "both")
        if several and param in _CLASSIFIER_OUTPUTS:
            raise InvalidInputError(
                f"evaluator={name} reads {param}, which only classifiers write, but labelCol="
                f"{estimator.getLabelCol()!r} holds several numbers per row (a regression of several outputs)")
        if several and param == "predictionCol":
            raise InvalidInputError(
                f"evaluator={name} reads {param}={wanted!r} as one number per row, but labelCol="
                f"{estimator.getLabelCol()!r} holds several numbers per row, so the model writes an array there")


def _read_outputs(evaluator: Evaluator) -> list[str]:
    """The TorchModel output Params whose columns Spark's own evaluators read."""
    if isinstance(evaluator, RegressionEvaluator):
        return ["predictionCol"]
    if isinstance(evaluator, BinaryClassificationEvaluator):
        return ["rawPredictionCol"]
    if isinstance(evaluator, MulticlassClassificationEvaluator):
        return ["predictionCol"] + (["probabilityCol"] if evaluator.getMetricName() == "logLoss" else [])
    return []


@contextmanager
def _tuner_run(tuner: SuccessiveHalving, trials: list[_Trial]) -> Iterator[None]:
    """Names each configuration's MLflow run after its param map and, when the estimator
    logs to MLflow where the process does, opens the tuner's own run (nested under an
    active one) for the configurations' runs to nest under."""
    from spark_torch_est.loggers import MLflowLogger

    maps = tuner.getEstimatorParamMaps()
    ambient = False
    for trial in trials:
        for item in trial.estimator.loggers:
            if isinstance(item, MLflowLogger):
                ambient = ambient or item._ambient()
                item.run_name = item.run_name or param_map_name(maps[trial.index])
    if not ambient:
        yield
        return
    import mlflow

    try:  # like a logger, the tuner's run never fails the search
        run = mlflow.start_run(run_name=f"SuccessiveHalving-{tuner.uid[-12:]}", nested=mlflow.active_run() is not None)
    except Exception as error:
        logger.warning("cannot open the tuner's MLflow run (the configurations' runs are not nested): %s: %s",
                       type(error).__name__, error)
        yield
        return
    with run:
        try:
            mlflow.log_params({"eta": tuner.getEta(), "minDuration": tuner.getMinDuration(), "maps": len(maps)})
        except Exception as error:
            logger.warning("cannot log the tuner's params to MLflow: %s: %s", type(error).__name__, error)
        yield


class SuccessiveHalvingModel(Model, TorchPersistence):
    """What :class:`SuccessiveHalving` found; ``transform`` is the best model's.

    Args:
        bestModel: The winner's :class:`TorchModel` after its last fit (at its maxEpochs).
        validationMetrics: Per param map, in map order: its metric at the last rung it reached.
        rungs: Every decision, ``{"rung", "index", "epochs", "metric", "kept"}``, in rung
            then map order.
    """

    def __init__(self, bestModel: TorchModel | None = None, validationMetrics: list[float] | None = None,
                 rungs: list[dict] | None = None) -> None:
        super().__init__()
        self.bestModel = bestModel
        self.validationMetrics = list(validationMetrics or [])
        self.rungs = [dict(r) for r in rungs or []]

    def _best(self) -> TorchModel:
        """The best model.

        Raises:
            InvalidInputError: This model was made without one.
        """
        if self.bestModel is None:
            raise InvalidInputError(f"{self.uid} holds no bestModel: it comes from SuccessiveHalving.fit or "
                                    "SuccessiveHalvingModel.load")
        return self.bestModel

    def _transform(self, dataset: DataFrame) -> DataFrame:
        return self._best().transform(dataset)

    def copy(self, extra: dict | None = None) -> SuccessiveHalvingModel:
        """A copy holding a copy of the best model."""
        return SuccessiveHalvingModel(self._best().copy(extra), self.validationMetrics, self.rungs)

    def _persisted_files(self, folder: str) -> dict[str, bytes]:
        """The best model's files and Params, the metrics and the rungs (see persistence.py)."""
        best = self._best()
        summary = {"validationMetrics": self.validationMetrics, "rungs": self.rungs,
                   "bestModel": {"uid": best.uid, "params": {p.name: v for p, v in best._paramMap.items()}}}
        return {**best._persisted_files(folder), "tuning.json": json.dumps(summary).encode()}

    @classmethod
    def _from_files(cls, read: Callable[[str], bytes | None], folder: str) -> SuccessiveHalvingModel:
        summary = json.loads(read_required(read, "tuning.json", folder))
        best = TorchModel._from_files(read, folder)
        best._resetUid(str(summary["bestModel"]["uid"]))
        best._set(**{str(k): v for k, v in summary["bestModel"]["params"].items() if best.hasParam(str(k))})
        rungs = [{"rung": int(r["rung"]), "index": int(r["index"]), "epochs": int(r["epochs"]),
                  "metric": float(r["metric"]), "kept": bool(r["kept"])} for r in summary["rungs"]]
        return cls(best, [float(m) for m in summary["validationMetrics"]], rungs)
