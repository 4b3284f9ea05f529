"""[driver] A tuner's maps trained together: one barrier job per split instead of one per map.

``CrossValidator`` and ``TrainValidationSplit`` call ``fitMultiple`` with every map of a
split. Where the maps change only what a rank trains (the config, batch size, epochs, seed,
precision; :data:`TOGETHER_PARAMS`), not which rows the ranks read or how the job runs, the
estimator trains them in one job: the ranks read and lay out the rows once, meet once, and
train each map's new run in turn (``TaskSpec.together``), each exactly as its own fit would
(the same rows, seeds and steps: the same model). A job's launch, its rows and its teardown
are then paid once per split rather than once per map, which is most of a small fit's time.
Rank 0 delivers each run's checkpoint over the channel as the run ends, so the tuner
evaluates that model while the next runs train.

Anything else is fitted one map at a time, as pyspark does, and the fit's log says why: a
map that sets another Param, loggers (each map's fit is its own logged run), ``minWorkers``,
a LightningModule, ``strategy='fsdp'``, Spark Connect. So is every map the job did not
return a model for when it fails: those fits apply the failure policy, and raise what a fit
of that map raises.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql.utils import is_remote

from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.cluster.launcher import Launcher
from spark_torch_est.cluster.messages import Kind, RankMessage
from spark_torch_est.core import jvm
from spark_torch_est.core.progress import Progress
from spark_torch_est.core.protocol import unpack_runs
from spark_torch_est.core.running import fit_logger, running_fit
from spark_torch_est.core.spec import JOB_FIELDS, TaskSpec
from spark_torch_est.errors import IncompatibleCheckpointError, SparkTorchError, TrainingFailedError
from spark_torch_est.ingest.kept_registry import KeptIngest
from spark_torch_est.loggers.view import DriverView
from spark_torch_est.model import TorchModel
from spark_torch_est.planning import plan_fit

__all__ = ["Together", "TOGETHER_PARAMS", "together_refusal", "job_refusal", "RunViews"]

logger = fit_logger()

#: The Params a tuner's map may set for its maps to be trained together: they change what a
#: rank trains and how the model scores, not which rows the ranks read or how the job runs.
TOGETHER_PARAMS = frozenset({
    "config", "batchSize", "maxEpochs", "seed", "allowNonFinite", "precision", "compileModel",
    "checkpointInterval", "inferenceBatchSize", "predictionCol", "rawPredictionCol", "probabilityCol",
})


class Together:
    """The models of one split's maps, as ``fitMultiple`` hands them out: trained together
    in one job, started when the first is asked for, where they may be; each map's model as
    soon as its run ends, so a tuner evaluates it while the next ones train. A map whose
    model the job did not give (it may not train them, or failed first) is fitted on its own
    when its model is asked for, as pyspark does.

    Args:
        estimator: The split's copy of the estimator (``fitMultiple`` names its fits).
        dataset: The split's training rows.
        param_maps: Its maps.
    """

    def __init__(self, estimator: Any, dataset: DataFrame, param_maps: list[dict]) -> None:
        self.estimator = estimator
        self.dataset = dataset
        self.param_maps = param_maps
        self._copies: list[Any] = []
        self._views: RunViews | None = None
        self._checkpoints: dict[int, Checkpoint] = {}  # delivered, not handed out yet
        self._handed: set[int] = set()  # the maps whose model the job gave
        self._launcher: Launcher | None = None
        self._thread: threading.Thread | None = None
        self._started = self._ended = False
        self._changed = threading.Condition()

    def model(self, index: int) -> TorchModel:
        """The model of map ``index``, once (called from a tuner's threads, as pyspark's
        ``fitMultiple`` iterator asks); Ctrl-C while it waits cancels the job."""
        with self._changed:
            if not self._started:
                self._started = True
                try:
                    self._start()
                except BaseException:  # planning failed: no job, every map is fitted on its own
                    self._end()
                    raise
        try:
            with self._changed:
                while index not in self._checkpoints and not self._ended:
                    self._changed.wait(0.2)
        except KeyboardInterrupt:
            self._cancel()
            raise
        with self._changed:
            checkpoint = self._checkpoints.pop(index, None)  # the driver holds no model it handed out
            if checkpoint is not None:
                self._handed.add(index)
        if checkpoint is not None:
            return self._copies[index]._fitted(checkpoint)
        if index in self._handed:
            raise ValueError(f"the model of map {index} was handed out already")
        return self.estimator.fit(self.dataset, self.param_maps[index])

    def _start(self) -> None:
        """Plans every map and starts their job in a thread; or, said in the fit's log, leaves
        them to be fitted one at a time."""
        estimator, maps = self.estimator, self.param_maps
        refusal = together_refusal(estimator, maps)
        if refusal is None:
            copies = [estimator.copy(params) for params in maps]
            try:
                first = plan_fit(copies[0], copies[0]._run_creators, self.dataset, None, None, copies[0]._fresh_hooks)
                plans = [first] + [plan_fit(c, c._run_creators, self.dataset, None, None, c._fresh_hooks, like=first)
                                   for c in copies[1:]]
            except SparkTorchError as error:  # its own fit raises it, when the tuner asks for its model
                refusal = f"a map's fit is refused ({type(error).__name__})"
            else:
                refusal = job_refusal([plan.spec for plan in plans])
        if refusal is not None:
            logger.info("the %d maps of %s are fitted one at a time: %s", len(maps), estimator._fold, refusal)
            self._end()
            return
        self._copies = copies
        workers = estimator.getNumWorkers()
        spec = dataclasses.replace(plans[0].spec, together=tuple(plan.spec for plan in plans[1:]))
        rows = KeptIngest(self.dataset.sparkSession, first.frame, first.source, workers, estimator.getKeepIngestedMB(),
                          first.staging)
        self._views = RunViews([DriverView(c.getShowProgress(), plan.progress, plan.target, workers * c.getBatchSize(),
                                           estimator._search_name(params))
                                for c, plan, params in zip(copies, plans, maps)])
        launching = f"launching {workers} rank{'s' if workers > 1 else ''} (a Spark barrier job) to train the " \
                    f"{len(maps)} maps of {estimator._fold} in turn on rows read once"
        view = self._views.views[0]
        self._launcher = Launcher(self.dataset.sparkSession, rows, 0, estimator.getSlotWaitTimeout(),
                                  self._views.handle, on_run=self._delivered,
                                  on_phase=lambda text: view.phase(text or launching))
        view.phase(launching)
        self._thread = threading.Thread(target=self._run, args=(spec, jvm.in_caller_properties(
            self.dataset.sparkSession.sparkContext)), name="spark_torch_est-together", daemon=True)
        self._thread.start()

    def _run(self, spec: TaskSpec, as_caller: Callable[[], None]) -> None:
        """The job (in its thread): each checkpoint as it comes, the rest with its result."""
        maps, fold = len(self.param_maps), self.estimator._fold
        assert self._launcher is not None and self._views is not None
        try:
            as_caller()
            with running_fit(f"{maps} maps ({fold})"):
                packed = self._launcher.run(spec, Progress())
            for index, blob in enumerate(unpack_runs(packed, maps)):
                if blob:
                    self._delivered(index, blob)
            with self._changed:
                missing = [index for index in range(maps) if index not in self._checkpoints.keys() | self._handed]
            if missing:
                raise TrainingFailedError(f"the job returned no checkpoint for maps {missing}")
        except KeyboardInterrupt:
            logger.warning("the job training the %d maps of %s was cancelled", maps, fold)
        except BaseException as error:  # noqa: B036 - the maps without a model are fitted on their own
            logger.warning("training the %d maps of %s together in one job failed (%s: %s); the maps it did not "
                           "train are fitted one at a time", maps, fold, type(error).__name__, error)
        finally:
            self._launcher.rows.close()  # the staged rows, if any
            self._end()

    def _end(self) -> None:
        """No more models will come from a job: the views close, the waiting threads go on."""
        if self._views is not None:
            self._views.close()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def _delivered(self, index: int, blob: bytes) -> None:
        """Map ``index``'s checkpoint (from a channel thread, or with the job's result)."""
        try:
            checkpoint = Checkpoint.from_bytes(blob)
        except IncompatibleCheckpointError as error:  # the map is fitted on its own
            logger.warning("map %d's checkpoint from the job cannot be read: %s", index, error)
            return
        with self._changed:
            self._checkpoints[index] = checkpoint
            self._changed.notify_all()

    def _cancel(self) -> None:
        """Cancels the job and waits for its thread."""
        if self._launcher is not None:
            self._launcher.stop()
        if self._thread is not None:
            self._thread.join(60)


def together_refusal(estimator: Any, param_maps: Sequence[dict]) -> str | None:
    """Why the maps of a split are not trained together (see the module's docstring), or
    None when they may be, as far as the Params tell (:func:`job_refusal` checks their plans)."""
    if len(param_maps) < 2:
        return "a split of one map"
    for params in param_maps:
        for param in params:
            name = getattr(param, "name", param)
            if name not in TOGETHER_PARAMS:
                return f"a map sets {name}, which may change the rows or the job"
    if estimator.loggers:
        return "each map's fit is a run of the estimator's loggers"
    if estimator.getMinWorkers() is not None:
        return "minWorkers is set (a job may shrink)"
    if estimator.getStrategy() != "ddp":
        return f"strategy={estimator.getStrategy()!r}"
    if is_remote():
        return "Spark Connect"
    return None


def job_refusal(specs: Sequence[TaskSpec]) -> str | None:
    """Why the planned maps cannot share one job (their jobs differ, or a LightningModule,
    whose Trainer owns its run), or None."""
    first = specs[0]
    if first.lightning is not None:
        return "the model is a LightningModule"
    for spec in specs[1:]:
        for name in JOB_FIELDS:
            if getattr(spec, name) != getattr(first, name):
                return f"their jobs differ in {name}"
    return None


class RunViews:
    """The progress of the runs one job trains in turn: a view for each, and the next takes
    over when rank 0 says a run ended (``RankMessage.for_run_done``); the ranks' log lines
    go to the current one.

    Args:
        views: One per run, in the job's order.
    """

    def __init__(self, views: Sequence[DriverView]) -> None:
        self.views = list(views)
        self._current = 0
        self._lock = threading.Lock()

    def handle(self, message: RankMessage) -> None:
        """Handles one message from a rank (called from channel threads)."""
        with self._lock:
            view = self.views[self._current]
            if message.kind is Kind.RUN_DONE:
                if not 0 <= message.run < len(self.views):
                    return
                done = self.views[message.run]
                done.finish(message.progress, [])
                done.close()
                if message.run + 1 < len(self.views):
                    self._current = message.run + 1
                    self.views[self._current].phase(f"training map {self._current + 1} of {len(self.views)}")
                return
        view.handle(message)

    def close(self) -> None:
        """Closes every view."""
        for view in self.views:
            view.close()
