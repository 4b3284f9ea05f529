"""[executor] One rank of a LightningModule's fit: Lightning's own ``Trainer`` runs the module on
the process group the task joined through the authenticated rendezvous.

The Trainer gets a cluster environment that reports the task's rank and a DDP strategy that
takes the process group as it is (no launcher, no ``init_process_group``); its training
batches are the run's epoch order (:mod:`spark_torch_est.ingest.canonical`), no
``DistributedSampler``: ``(features, label)``, ``(*inputs, label)`` for typed inputs, the
weight last under ``weightCol``. What the package adds sits around Lightning's loops:

- each training batch counts into the run's progress and its loss (kept on the device) into
  the epoch's ``train_loss``; a fit that stops in the middle of an epoch stops right after a
  batch, where Lightning's own mid-epoch checkpoints are taken;
- after each epoch's end (its hooks, validation and logging) the epoch's metrics logged with
  ``on_epoch`` (and what callbacks logged, ``LearningRateMonitor``'s rates) become the
  history entry; the ranks agree on ``trainer.should_stop`` and the driver's loggers may stop
  the fit;
- a checkpoint holds the module's weights as the package's checkpoints do and Lightning's own
  checkpoint beside them (optimizers, schedulers, loops, callbacks' state), which the next fit
  hands back to ``Trainer.fit(ckpt_path=...)``.

Lightning 2.6 broadcasts a SIGTERM flag before every step (a collective and a host read per
step); Spark ends a task otherwise, so this Trainer leaves that broadcast out.
"""

from __future__ import annotations

import collections
import importlib
import logging
import math
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spark_torch_est.checkpoints.checkpoint import Checkpoint, check_compatible
from spark_torch_est.checkpoints.storage import CheckpointDir
from spark_torch_est.core import rng
from spark_torch_est.core.progress import Progress
from spark_torch_est.core.ranks import Ranks
from spark_torch_est.core.spec import TaskSpec
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.ingest.agreement import AgreedRows, agree_on_rows
from spark_torch_est.ingest.canonical import move_rows
from spark_torch_est.ingest.tables import IngestedRows
from spark_torch_est.train.creators import CreatorError, Creators
from spark_torch_est.train.hooks import HookSet
from spark_torch_est.train.lightning import namespace_of, scorer, step_batch, trainer_args
from spark_torch_est.train.losses import NonFiniteLossError
from spark_torch_est.train.reporter import SILENT, Reporter
from spark_torch_est.train.step import Stage

__all__ = ["LightningTrainer", "LIGHTNING_KEYS"]

logger = logging.getLogger(__name__)

#: What the package keeps of Lightning's checkpoint (the weights are the package's own).
LIGHTNING_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks", "optimizer_states",
                  "lr_schedulers")
#: Where the package keeps each rank's epoch aggregates of ``self.log(on_epoch=True)`` in a
#: checkpoint taken in the middle of an epoch (Lightning's own checkpoint does not hold them).
EPOCH_RESULTS = "spark_torch_est_epoch_results"


class _Pause(Exception):
    """Not an error: the fit's target is reached in the middle of an epoch."""


def _classes(namespace: str) -> tuple[type, type, type, type]:
    """The cluster environment, strategy, callback and logger classes of ``namespace``
    (``lightning.pytorch`` or ``pytorch_lightning``), made once per namespace."""
    cached = _CLASSES.get(namespace)
    if cached is not None:
        return cached
    package = importlib.import_module(namespace)
    environments = importlib.import_module(f"{namespace}.plugins.environments")
    ClusterEnvironment = environments.ClusterEnvironment  # noqa: N806 - a class
    DDPStrategy = importlib.import_module(f"{namespace}.strategies").DDPStrategy  # noqa: N806
    LoggerBase = importlib.import_module(f"{namespace}.loggers").Logger  # noqa: N806

    class TaskEnvironment(ClusterEnvironment):  # type: ignore[misc, valid-type]
        """The barrier task's rank: the process exists and its group is joined already."""

        def __init__(self, rank: int, world_size: int) -> None:
            super().__init__()
            self._rank, self._world_size = rank, world_size

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return "127.0.0.1"  # never used: the process group exists

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            return False

        def world_size(self) -> int:
            return self._world_size

        def set_world_size(self, size: int) -> None:
            pass

        def global_rank(self) -> int:
            return self._rank

        def set_global_rank(self, rank: int) -> None:
            pass

        def local_rank(self) -> int:
            return 0

        def node_rank(self) -> int:
            return self._rank

        def teardown(self) -> None:
            pass

    class TaskDDPStrategy(DDPStrategy):  # type: ignore[misc, valid-type]
        """DDP on the process group the task joined: no launcher, no new group, no reseeding."""

        def _configure_launcher(self) -> None:
            self._launcher = None

        def setup_distributed(self) -> None:
            self.set_world_ranks()
            self._process_group_backend = dist.get_backend()

        def loss_share(self) -> float:
            """How many times this rank's loss counts in the step now training (see
            :class:`_EpochBatches`); the trainer sets it."""
            return 1.0

        def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            share = self.loss_share()
            return super().backward(closure_loss if share == 1 else closure_loss * share, optimizer, *args, **kwargs)

    class Recorder(LoggerBase):  # type: ignore[misc, valid-type]
        """Keeps what is logged to the Trainer's logger (``LearningRateMonitor``'s rates, say)
        for the epoch's history entry."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: dict[str, float] = {}

        @property
        def name(self) -> str:
            return "spark_torch_est"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            for key, value in metrics.items():
                self.seen[key] = float(value)

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    made = (TaskEnvironment, TaskDDPStrategy, package.Callback, Recorder)
    _CLASSES[namespace] = made
    return made


_CLASSES: dict[str, tuple[type, type, type, type]] = {}


class _TeardownRefs:
    """What the worker's teardown must see freed: the DDP wrapper Lightning made."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    def teardown_refs(self) -> list[weakref.ref]:
        return self.refs


class _EpochBatches:
    """The training batches of the epoch in progress, in the run's order, as Lightning's
    ``train_dataloader``: one ``iter()`` per epoch, ``len()`` the epoch's steps. Each batch's
    rows of all ranks wait in ``samples``, and its loss's share in ``shares``, for the step
    that trains on it (Lightning fetches a batch ahead).

    The epoch's last step is short when its rows do not fill a global batch (every row once,
    none repeated): a rank's loss then counts its rows times the ranks over the step's rows,
    so the gradient is the mean over the step's rows as in the package's own loop, and a rank
    left with no row trains one row of its previous batch with a share of 0 (DDP needs every
    rank's backward), counted nowhere."""

    def __init__(self, owner: LightningTrainer) -> None:
        self.owner = owner
        self.samples: collections.deque[int] = collections.deque()
        self.shares: collections.deque[float] = collections.deque()

    def share(self) -> float:
        """The loss share of the batch training now."""
        return self.shares[0] if self.shares else 1.0

    def __len__(self) -> int:
        return self.owner.epoch_steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return self._batches()

    def _batches(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """The epoch's batches from where it stands. The rows are placed at the first batch
        (a collective on another number of ranks than the run's logical shards), not when
        Lightning only checks that the loader iterates."""
        owner = self.owner
        plan = owner.rows.epoch(owner.progress.epoch, owner.offset)
        self.samples.clear()
        self.shares.clear()
        for step in range(plan.steps):
            inputs, labels, weights = plan.take(step)
            samples = plan.samples(step)
            share = len(labels) * self.owner.ranks.world_size / samples
            if not len(labels):  # a stand-in row the rank holds, the same however the fit was split
                if not len(plan.table):
                    raise InvalidInputError(f"rank {self.owner.ranks.rank} holds no training row: the DataFrame "
                                            "has fewer rows than numWorkers; lower numWorkers")
                inputs, labels, weights = plan.stand_in()
            self.samples.append(samples)
            self.shares.append(share)
            yield self.owner.batch(inputs, labels, weights)

    def state_dict(self) -> dict[str, int]:
        """Where the epoch stands (Lightning then knows the batches resume where they stopped)."""
        return {"sample_in_epoch": self.owner.progress.sample_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Nothing to load: the run's progress places the batches."""


class _ValidationBatches:
    """This rank's validation rows in ``batchSize`` batches, as Lightning's ``val_dataloader``."""

    def __init__(self, owner: LightningTrainer) -> None:
        self.owner = owner

    def __len__(self) -> int:
        return -(-len(self.owner.rows.validation) // self.owner.spec.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        table, size = self.owner.rows.validation, self.owner.spec.batch_size
        for start in range(0, len(table), size):
            yield self.owner.batch(*table.slice(start, start + size))


class LightningTrainer:
    """Runs one fit of a LightningModule on one rank (the interface of
    :class:`spark_torch_est.train.loop.Trainer` that the worker uses).

    Args:
        creators: The user's creators (the model a LightningModule), unpickled on this rank.
        spec: The fit's description (``spec.lightning``: the Trainer's arguments).
        ingested: This rank's rows.
        rank: This rank.
        world_size: Number of ranks.
        device: Where the module lives.
        reporter: Sends progress to the driver (rank 0).
    """

    def __init__(self, creators: Creators, spec: TaskSpec, ingested: IngestedRows, rank: int, world_size: int,
                 device: torch.device, reporter: Reporter = SILENT) -> None:
        self.creators, self.spec, self.device, self.reporter = creators, spec, device, reporter
        self.ingested: IngestedRows | None = ingested
        self.ranks = Ranks(rank, world_size, device)
        self.hooks = HookSet({})
        self.strategy = _TeardownRefs()
        self._stage = Stage("setup")
        self.rows: AgreedRows
        self.progress = Progress()
        self.history: list[dict] = []
        self.offset = 0
        self.epoch_steps = 0  # steps of the epoch in progress: the training loader's len()
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._loss_count = torch.zeros((), dtype=torch.float64, device=device)
        self._partial = (0.0, 0.0)  # the epoch's sums before this fit (rank 0)
        self._pausing: dict[str, Any] | None = None  # Lightning's state where the fit stops mid-epoch
        self._output_shape: list[int] = []
        self._carried: dict[str, torch.Tensor] | None = None  # this rank's epoch aggregates before this fit

    @property
    def stage(self) -> str:
        """The stage running now, reported if something raises."""
        return self._stage.name

    def batch(self, inputs: list[torch.Tensor], labels: torch.Tensor,
              weights: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """A batch as the module's steps take it (see :func:`step_batch`)."""
        return step_batch(self.spec.schema.model_inputs(inputs), labels, weights)

    # ------------------------------------------------------------------------ the run

    def run(self) -> bytes | None:
        """Trains to the spec's target; returns the checkpoint bytes on rank 0, else None."""
        spec = self.spec
        resume = Checkpoint.from_bytes(spec.resume) if spec.resume is not None else None
        ingested, self.ingested = self.ingested, None
        if ingested is None:
            raise RuntimeError("a LightningTrainer runs one fit: make another for the next")
        with self._stage.at("collective"):
            self.rows = agree_on_rows(ingested, spec, self.ranks, resume.shards if resume is not None else None)
            self._spread_validation()
        self.epoch_steps = self.rows.steps_per_epoch
        torch.manual_seed(spec.seed)
        module = self.creators.build_model()
        namespace = namespace_of(module)
        if namespace is None:
            raise CreatorError("model", f"the model creator returned {type(module).__name__}, not a LightningModule")
        if resume is not None:
            check_compatible(module.state_dict(), resume.model_state)
            module.load_state_dict(resume.model_state)
            self._restore(resume)
        self._output_shape = self._shape(module)
        if resume is not None:
            rng.restore(resume.rng_states[self.ranks.rank % len(resume.rng_states)], self.device)
        else:
            rng.seed_all(spec.seed, self.ranks.rank)
        trainer = self._trainer(namespace)
        val = _ValidationBatches(self) if self.rows.val_rows else None
        ckpt_dir = tempfile.mkdtemp(prefix="spark_torch_est-lightning-")
        try:  # Lightning's checkpoint of the run as a file for the Trainer, gone however the fit ends
            ckpt_path = self._lightning_file(resume, ckpt_dir) if resume is not None else None
            with self._stage.at("train"):
                trainer.fit(module, train_dataloaders=self.train_batches, val_dataloaders=val, ckpt_path=ckpt_path)
        finally:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        with self._stage.at("checkpoint"):
            state = self._pausing if self._pausing is not None else self._lightning_state(trainer)
            return self._checkpoint_bytes(module, state)

    def _spread_validation(self) -> None:
        """Collective: when some rank holds no validation row and others do, the validation
        rows are dealt out over the ranks, so that every rank runs Lightning's validation
        loop and its ``sync_dist`` collectives (a rank without a batch skips the loop, and the
        others would wait for it).

        Raises:
            InvalidInputError: Fewer validation rows than ranks.
        """
        counts = self.ranks.counts(torch.tensor([len(self.rows.validation)], dtype=torch.int64))[:, 0]
        total, world, rank = int(counts.sum()), self.ranks.world_size, self.ranks.rank
        if not total or bool((counts > 0).all()):
            return
        if total < world:
            raise InvalidInputError(f"validationIndicatorCol marks {total} rows, fewer than the {world} ranks: each "
                                    "rank runs the LightningModule's validation on rows of its own; mark more rows "
                                    "or lower numWorkers")
        start = int(counts[:rank].sum())
        ids = torch.arange(start, start + int(counts[rank]), dtype=torch.int64)
        self.rows.validation = move_rows(self.rows.validation, ids % world, ids // world,
                                         len(range(rank, total, world)), self.ranks, None)

    def _trainer(self, namespace: str) -> Any:
        """Lightning's Trainer on this task: its environment, strategy, callbacks and logger,
        and the user's ``trainerArgs``."""
        Environment, Strategy, Callback, Recorder = _classes(namespace)  # noqa: N806 - classes
        pl = importlib.import_module(namespace)
        owner = self

        class Bridge(Callback):  # type: ignore[misc, valid-type]
            """The package's side of each step: progress, the loss, a stop mid-epoch."""

            def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
                model = trainer.strategy.model
                if model is not pl_module:
                    owner.strategy.refs = [weakref.ref(model)]
                    reducer = getattr(model, "reducer", None)
                    if reducer is not None:
                        owner.strategy.refs.append(weakref.ref(reducer))

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                   batch_idx: int) -> None:
                owner.step_done(trainer, outputs, batch)

        lightning = dict(self.spec.lightning or {})
        args = dict(lightning.get("trainer_args") or {})
        args.setdefault("enable_checkpointing", False)
        args.setdefault("enable_progress_bar", False)
        args.setdefault("enable_model_summary", False)
        args.setdefault("default_root_dir", tempfile.gettempdir())
        args.setdefault("log_every_n_steps", max(1, min(50, self.rows.steps_per_epoch)))  # no warning for short epochs
        self.recorder = Recorder()
        strategy = Strategy(parallel_devices=[self.device], cluster_environment=Environment(self.ranks.rank,
                                                                                             self.ranks.world_size),
                            process_group_backend=dist.get_backend(), timeout=None)
        trainer = pl.Trainer(
            **trainer_args(namespace, self.device, self.spec.precision), num_nodes=self.ranks.world_size,
            strategy=strategy, max_epochs=int(lightning.get("max_epochs", -1)), use_distributed_sampler=False,
            callbacks=[*self.creators.callbacks, Bridge()], logger=self.recorder, **args)
        self.train_batches = _EpochBatches(self)
        strategy.loss_share = self.train_batches.share  # type: ignore[method-assign]
        epoch_loop = trainer.fit_loop.epoch_loop
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            epoch_loop._broadcast_sigterm_tensor = lambda: None  # see the module's docstring
        after_batch = epoch_loop.on_advance_end
        after_epoch = trainer.fit_loop.on_advance_end

        def epoch_loop_advance_end(*args: Any, **kwargs: Any) -> None:
            after_batch(*args, **kwargs)
            if self._pausing is not None:
                raise StopIteration  # Lightning's loops end here, as after the epoch's last batch

        def fit_loop_advance_end() -> None:
            if self._pausing is not None:
                raise StopIteration
            after_epoch()
            if self.end_epoch(trainer):
                raise StopIteration

        epoch_loop.on_advance_end = epoch_loop_advance_end
        trainer.fit_loop.on_advance_end = fit_loop_advance_end
        return trainer

    # ------------------------------------------------------------------ each step

    def step_done(self, trainer: Any, outputs: Any, batch: tuple[torch.Tensor, ...]) -> None:
        """After a training batch: counts it into the progress, its loss into the epoch's
        mean (on the device), and stops the fit when its target is reached mid-epoch."""
        if self._carried is not None:
            self._add_carried(trainer)
        samples = self.train_batches.samples.popleft()
        share = self.train_batches.shares.popleft()
        self.progress = self.progress.to_next_batch(samples)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        weights = batch[-1] if self.spec.columns.weight is not None else None
        rows = weights.sum().double() if weights is not None else float(len(batch[-1]))
        if isinstance(loss, torch.Tensor) and share:  # a rank's stand-in row (share 0) is no row of the epoch
            self._loss_sum += loss.detach().double() * rows
            self._loss_count += rows
        ends_epoch = trainer.fit_loop.epoch_loop.batch_progress.current.ready >= self.epoch_steps
        if self._due("ba"):
            self._write_checkpoint(trainer.lightning_module, self._lightning_state(trainer))
        if not ends_epoch and self.spec.target.reached(self.progress):
            self._pausing = self._lightning_state(trainer)

    # ------------------------------------------------------------ end of an epoch

    def end_epoch(self, trainer: Any) -> bool:
        """After the epoch's end in Lightning's loop: the history entry, the driver's view,
        the ranks' agreement to stop, a checkpoint when due. Returns whether the fit stops."""
        entry = self._entry(trainer)
        self.progress = self.progress.to_next_epoch()
        self.offset = 0
        self.epoch_steps = self.rows.steps_per_epoch
        self.history.append(entry)
        self.reporter.step(self.progress, entry.get("train_loss", float("nan")), self.rows.steps_per_epoch)
        self.reporter.epoch(entry)
        stop = bool(trainer.should_stop)
        wait = self.spec.stop_wait_s
        reached = self.spec.target.reached(self.progress)
        if wait is not None and not reached and self.reporter.stop_asked(entry["epoch"], wait):
            logger.info("rank %d: a logger on the driver stops the fit after epoch %d", self.ranks.rank,
                        entry["epoch"])
            stop = True
        if self.ranks.world_size > 1:
            with self._stage.at("collective"):
                stop = bool(self.ranks.all_reduce(torch.tensor([int(stop)]), dist.ReduceOp.MAX).item())
        trainer.should_stop = stop
        if self._due("ep"):
            self._write_checkpoint(trainer.lightning_module, self._lightning_state(trainer))
        logger.info("rank %d: epoch %d %s", self.ranks.rank, entry["epoch"], entry)
        return stop or reached

    def _entry(self, trainer: Any) -> dict[str, Any]:
        """The epoch's history entry: its mean training loss, the metrics logged with
        ``on_epoch`` in training and validation, and what callbacks logged."""
        with self._stage.at("collective"):
            totals = self.ranks.all_reduce(torch.stack([self._loss_sum, self._loss_count]).cpu())
        partial_sum, partial_count = self._partial
        total, count = float(totals[0]) + partial_sum, float(totals[1]) + partial_count
        self._loss_sum.zero_()
        self._loss_count.zero_()
        self._partial = (0.0, 0.0)
        entry: dict[str, Any] = {"epoch": self.progress.epoch + 1}
        if count:  # training_step returned its loss (not under manual optimization returning None)
            train_loss = total / count
            if not math.isfinite(train_loss) and not self.spec.allow_non_finite:
                raise NonFiniteLossError(f"the epoch's mean training loss is {train_loss} in epoch "
                                         f"{self.progress.epoch + 1}; set allowNonFinite=True to train on")
            entry["train_loss"] = train_loss
        entry["world_size"] = self.ranks.world_size
        metrics = trainer.callback_metrics
        logged: set[str] = set()
        loops = [trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.val_loop]
        for loop in loops:
            for result in getattr(loop, "_results", {}).values():
                meta = result.meta
                logged.update({meta.name, meta.forked_name(True), meta.forked_name(False)})
                if meta.on_epoch and meta.name in metrics:
                    entry[meta.name] = float(metrics[meta.name])
        for key, value in self.recorder.seen.items():
            if key not in logged and key not in entry and key not in ("epoch", "step"):
                entry[key] = value
        self.recorder.seen.clear()
        parent = self.spec.parent
        if parent is not None and all(e.get("branch_of") != str(parent) for e in self.history):
            entry["branch_of"] = str(parent)
        return entry

    # ---------------------------------------------------------------- checkpoints

    def _restore(self, resume: Checkpoint) -> None:
        """Continues the run of ``resume``: its counters and the epoch's loss so far."""
        self.progress, self.history = resume.progress, resume.history
        if self.ranks.rank == 0 and self.progress.batch_in_epoch > 0:
            self._partial = resume.partial_loss
        done = self.progress.sample_in_epoch
        self.offset = self.rows.offset(done) if done else 0
        # the steps it took and those left: other than a whole epoch's when the global batch
        # changed with numWorkers in the middle of the epoch
        self.epoch_steps = self.progress.batch_in_epoch + self.rows.steps_left(self.offset)

    def _lightning_file(self, resume: Checkpoint, folder: str) -> str | None:
        """Lightning's checkpoint of ``resume`` as a file for ``Trainer.fit(ckpt_path=...)``;
        this rank's epoch aggregates kept aside for its first step (see :meth:`_add_carried`)."""
        state = dict(resume.lightning_state or {})
        if not state:
            return None
        carried = state.pop(EPOCH_RESULTS, None)
        if carried is not None and self.progress.batch_in_epoch > 0:
            values = carried["values"]
            if len(values) == self.ranks.world_size:
                self._carried = dict(zip(carried["keys"], values[self.ranks.rank]))
            elif self.ranks.rank == 0:
                logger.warning("the epoch in progress began on %d ranks and goes on on %d: its values logged with "
                               "on_epoch cover this fit's part of it", len(values), self.ranks.world_size)
        path = os.path.join(folder, "resume.ckpt")
        torch.save({**state, "state_dict": resume.model_state}, path)
        return path

    def _lightning_state(self, trainer: Any) -> dict[str, Any]:
        """Collective in the middle of an epoch: what the package keeps of Lightning's
        checkpoint as it is now, with every rank's epoch aggregates so far."""
        dumped = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        state = {key: value for key, value in dumped.items() if key in LIGHTNING_KEYS or key[:1].isupper()}
        if self.progress.batch_in_epoch > 0:
            state[EPOCH_RESULTS] = self._epoch_results(trainer)
        return state

    @staticmethod
    def _epoch_metrics(trainer: Any) -> dict[str, Any]:
        """The training loop's values logged with ``on_epoch`` (tensors), by key."""
        results = trainer.fit_loop.epoch_loop._results
        return {key: result for key, result in sorted(results.items())
                if result.is_tensor and result.meta.on_epoch}

    def _epoch_results(self, trainer: Any) -> dict[str, Any]:
        """Collective: every rank's aggregates of the epoch so far (``value`` and rows of each
        value logged with ``on_epoch``), to continue the epoch's means exactly."""
        metrics = self._epoch_metrics(trainer)
        table = torch.zeros(self.ranks.world_size, len(metrics), 2, dtype=torch.float64)
        for index, result in enumerate(metrics.values()):
            count = getattr(result, "cumulated_batch_size", torch.tensor(0))
            table[self.ranks.rank, index] = torch.stack([result.value.detach().double().cpu(),
                                                         count.detach().double().cpu()])
        with self._stage.at("collective"):
            table = self.ranks.all_reduce(table)
        return {"keys": list(metrics), "values": table}

    def _add_carried(self, trainer: Any) -> None:
        """After the first step of a fit that continues an epoch: this rank's aggregates of
        the epoch's earlier steps join those of the step (a sum, or the max or min, as the
        value reduces), so the epoch's logged means equal those of one straight fit."""
        carried, self._carried = self._carried or {}, None
        for key, result in self._epoch_metrics(trainer).items():
            if key not in carried:
                continue
            value, count = carried[key]
            before = value.to(result.value.dtype).to(result.value.device)
            meta = result.meta
            if meta.is_max_reduction or meta.is_min_reduction:
                result.value = meta.reduce_fx(before, result.value)
            else:
                result.value = before + result.value
            if meta.is_mean_reduction:
                result.cumulated_batch_size = count.long().to(result.value.device) + result.cumulated_batch_size

    def _due(self, unit: str) -> bool:
        every = self.spec.checkpoint_every
        return self.spec.checkpoint_dir is not None and every is not None and every.due(self.progress, unit)

    def _write_checkpoint(self, module: nn.Module, state: dict[str, Any]) -> None:
        """Collective: a periodic checkpoint in ``checkpointDir``."""
        started = time.perf_counter()
        blob = self._checkpoint_bytes(module, state)
        if blob is not None:
            directory = CheckpointDir(self.spec.checkpoint_dir or "", run_id=self.spec.run_id)
            path = directory.write(blob, self.progress.epoch, self.progress.global_step)
            logger.info("rank 0: wrote %s (%.1f MB) in %.2fs", path, len(blob) / 1e6, time.perf_counter() - started)

    def _checkpoint_bytes(self, module: nn.Module, state: dict[str, Any]) -> bytes | None:
        """Collective: every rank's RNG state and loss sums; rank 0 returns the checkpoint."""
        with self._stage.at("collective"):
            rng_states = self.ranks.rng_states()
            totals = self.ranks.all_reduce(torch.stack([self._loss_sum, self._loss_count]).cpu()).tolist()
        if self.ranks.rank != 0:
            return None
        model_state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        broken = [k for k, v in model_state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if broken and not self.spec.allow_non_finite:
            raise NonFiniteLossError(f"the module's weights became NaN or infinite ({', '.join(broken[:5])}) by "
                                     f"epoch {self.progress.epoch + 1}; set allowNonFinite=True to keep them")
        spec, train = self.spec, self.rows.train
        partial = (totals[0] + self._partial[0], totals[1] + self._partial[1])
        return Checkpoint.build(
            run_id=spec.run_id, fit_id=spec.fit_id, progress=self.progress, history=self.history,
            partial_loss=partial, epoch_rows=sum(self.rows.train_rows), world_size=self.ranks.world_size,
            shards=self.rows.shards, data_source=spec.data_source, seed=spec.seed, optimizer_made=[],
            output_shape=self._output_shape, label_kind="float" if train.labels.dtype.is_floating_point else "int",
            input_schema=spec.schema.to_dict(),
            input_rows=[list(c.shape) if c.shape is not None else list(rows.row_shape) if rows.row_shape is not None
                        else None for c, rows in zip(spec.schema.columns, train.inputs)],
            model=model_state, optimizer={}, scheduler=None, rng=rng_states, hooks={},
            precision=spec.precision, scaler=None, strategy=spec.strategy, parent=spec.parent,
            lightning=_to_cpu(state),
        ).to_bytes()

    def _shape(self, module: nn.Module) -> list[int]:
        """The module's output shape per row as scoring calls it (its ``predict_step`` where it
        defines one, else its ``forward``) on two rows (eval mode, no RNG drawn); ``[]`` when it
        has neither (it trains; ``transform`` needs one)."""
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                outputs = scorer(module)[1](self.spec.schema.model_inputs(self.rows.train.slice(0, 2)[0]), 0)
            return list(outputs.shape[1:]) if isinstance(outputs, torch.Tensor) else []
        except NotImplementedError:
            return []
        finally:
            module.train(was_training)


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor on the CPU (a checkpoint's tensors are)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
