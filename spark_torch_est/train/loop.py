"""[executor] The training loop of one rank in three levels, as mmengine's loops: the run
(:meth:`Trainer.run`), the epoch (:meth:`Trainer.run_epoch`) and the step
(:meth:`Trainer.run_step`), each with its hooks around it. Every rank runs the same
collectives in the same order.

The rows come agreed on by the ranks (:mod:`~spark_torch_est.ingest.agreement`); the model is
distributed by the fit's strategy (:mod:`~spark_torch_est.train.strategies`); a checkpoint is
built from one :class:`~spark_torch_est.train.run_state.RunState`; an epoch's end validates
with :class:`~spark_torch_est.train.validation.Validation`. Hook arguments are passed at each
call: the run's objects, the progress as it is, the step's :class:`~step.Batch`, outputs and
loss. The stage is set only by :meth:`~step.Stage.at`.

A step waits for nothing on the device: its loss stays there (:class:`~step.PendingLosses`)
until the loop reads the losses of several steps at once, every :data:`~step.READ_EVERY`
steps, at the end of an epoch and before any checkpoint. A NaN or infinite loss fails the fit
there, naming its step, before a checkpoint can hold it. The ranks combine their ``Control``
flags after a step only when a hook asks for it by naming ``control`` in a per-step stage.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.core import rng
from spark_torch_est.core.progress import Progress
from spark_torch_est.core.ranks import Ranks
from spark_torch_est.core.spec import TaskSpec
from spark_torch_est.ingest.agreement import AgreedRows, agree_on_rows
from spark_torch_est.ingest.canonical import EpochRows
from spark_torch_est.ingest.tables import IngestedRows
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.hooks import Control, HookSet
from spark_torch_est.train.losses import Loss, scalar_loss, zero_through
from spark_torch_est.train.metrics import MetricAccumulator, format_entry
from spark_torch_est.train.precision import Precision
from spark_torch_est.train.prefetch import prefetch
from spark_torch_est.train.reporter import SILENT, Reporter
from spark_torch_est.train.run_state import RunState
from spark_torch_est.train.step import Batch, Feed, PendingLosses, Stage, StepLoss, non_finite_loss
from spark_torch_est.train.strategies import Strategy, for_spec
from spark_torch_est.train.validation import Validation

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)


class _ProfilerNotice(logging.Filter):
    """Drops dynamo's "Profiler (record) function ... will be ignored": DDP's
    ``record_function`` spans, which a compiled graph leaves out, are the package's doing, not
    the user's; the warning came once per rank per fit."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Profiler function", "Profiler record function"))


_PROFILER_NOTICE = _ProfilerNotice()
#: Where dynamo logs it (torch 2.3 to 2.13).
_PROFILER_LOGS = ("torch._dynamo.variables.torch", "torch._dynamo.variables.ctx_manager")


class Trainer:
    """Runs one fit on one rank.

    Args:
        creators: The user's creators and hooks, unpickled on this rank.
        spec: The fit's description.
        ingested: This rank's rows.
        rank: This rank.
        world_size: Number of ranks.
        device: Where the model lives.
        reporter: Sends progress to the driver (rank 0); the default sends nothing.

    Attributes:
        hooks: The fit's hooks (``hooks.current_hook`` names a hook while it runs).
        rows: The rows as the ranks agreed on them; ``state``: the run's state (from setup).
        strategy: How the model is distributed (from setup; None before).
        model: The model; ``ddp_model``: the module a step calls (wrapped by the strategy,
            compiled with ``compileModel``).
    """

    def __init__(self, creators: Creators, spec: TaskSpec, ingested: IngestedRows, rank: int,
                 world_size: int, device: torch.device, reporter: Reporter = SILENT) -> None:
        self.creators, self.spec, self.device = creators, spec, device
        self.ingested: IngestedRows | None = ingested
        self.ranks = Ranks(rank, world_size, device)
        self.reporter = reporter
        self.hooks = HookSet(creators.hooks)
        self.control = Control()
        self.rows: AgreedRows
        self.state: RunState
        self.strategy: Strategy | None = None
        self._stage = Stage("setup")
        self._batch_idx = 0  # the index of the last training batch in its epoch
        self._run_args: dict[str, Any] = {"rank": rank, "world_size": world_size, "control": self.control,
                                          "device": device, "config": dict(creators.config)}
        self._sync_flags = world_size > 1 and (bool(self.hooks) or spec.stop_wait_s is not None)
        self._vote_each_step = self.hooks.votes_per_step  # a hook named control in a per-step stage
        self._losses = PendingLosses(device)
        self._epoch_rows: EpochRows  # the current epoch's rows of this rank (from its first step)
        self._compiling = False  # until the first step of a compiled model has run
        self.phases: dict[str, float] = {}  # seconds of the launch's phases, logged after the first step

    @property
    def stage(self) -> str:
        """The stage running now, reported if something raises."""
        return self._stage.name

    # ---------------------------------------------------------------- the three levels

    def run(self) -> bytes | None:
        """Trains to the spec's target; returns the checkpoint bytes on rank 0, else None."""
        resume = Checkpoint.from_bytes(self.spec.resume) if self.spec.resume is not None else None
        try:
            self._setup(resume)
            self._call("before_run")
            if resume is not None:
                rng.restore(resume.rng_states[self.ranks.rank % len(resume.rng_states)], self.device)
            else:
                rng.seed_all(self.spec.seed, self.ranks.rank)
            self._agree_on_flags()
            self.model.train()
            with self._stage.at("train"):
                while not (self.control.stop_training or self.spec.target.reached(self.state.progress)):
                    self.run_epoch()
            self._call("after_run", metrics=self.state.history[-1] if self.state.history else {})
            self._read_losses()
            with self._stage.at("checkpoint"):
                return self.state.result()
        except BaseException as error:  # the final checkpoint's too: a hook that alerts or cleans up hears of it
            self._on_exception(error)
            raise

    def run_epoch(self) -> None:
        """The rest of the current epoch: its steps, then its end (validation, history,
        checkpoint) unless the fit stops in the middle of it."""
        self.control.stop_epoch = False
        if self.state.progress.batch_in_epoch == 0:
            self._call("before_train_epoch", batch_idx=0)
            if self.hooks.has("before_train_epoch"):  # else the flags are as last combined
                self._agree_on_flags()
            if self.control.stop_training:  # asked before the epoch's first step: none of it runs
                return
        ended = self._run_steps()
        self._read_losses()
        if ended:
            self._end_epoch()

    def _run_steps(self) -> bool:
        """The epoch's remaining steps; returns whether the epoch ends with them (False: the
        fit stops in the middle of it)."""
        with self._stage.at("collective"):  # the same rows per step on any number of ranks
            epoch_rows = self._epoch_rows = self.rows.epoch(self.state.progress.epoch, self.state.offset)
        batches = prefetch((epoch_rows.take(step) for step in range(epoch_rows.steps)), self.feed.transfer)
        for step in range(epoch_rows.steps):
            if self.spec.target.reached(self.state.progress):
                return False
            self.run_step(self.feed.batch(*next(batches)), epoch_rows.samples(step), step)
            self._checkpoint_if_due("ba")
            if not self._vote_each_step:  # requests made during steps wait for the epoch's end
                continue
            self._agree_on_flags()
            if self.control.stop_training and step < epoch_rows.steps - 1:  # the epoch stays open
                return False
            if self.control.stop_training or self.control.stop_epoch:
                break
        return True

    def run_step(self, batch: Batch, samples: int, position: int) -> None:
        """One optimizer step on ``batch`` (``samples`` rows of all ranks; ``position``: the
        step's place in the epoch's plan) with the hooks around it: the default step, or the
        ``train_step`` of a hook."""
        self._batch_idx = self.state.progress.batch_in_epoch
        started = time.perf_counter()
        share = len(batch.labels) * self.ranks.world_size / samples  # 1 where the ranks' parts are equal
        replaced = self._call("before_train_iter", batch)
        if replaced is not None:
            batch = batch.replaced(replaced)
        if self.hooks.train_step is not None:
            loss, outputs = self._hook_step(batch, samples)
        else:
            loss, outputs = self._default_step(batch, samples, share)
        if self._compiling:
            self._report_compile(time.perf_counter() - started)
        if "first step" not in self.phases:
            self.phases["first step"] = time.perf_counter() - started
            took = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.phases.items())
            logger.debug("rank %d: the launch took %s", self.ranks.rank, took)
            self.reporter.note(__name__, f"the launch took {took}", logging.DEBUG)  # rank 0's, in the fit's log
        due = self._keep_loss(batch, loss, position)
        self._call("after_train_iter", batch, outputs=outputs, loss=loss)
        if due:
            self._read_losses()
        self.reporter.position(self.state.progress, self.rows.steps_per_epoch)

    # ------------------------------------------------------------------------ setup

    def _setup(self, resume: Checkpoint | None) -> None:
        """Agrees on the rows; builds the model (with the run's weights), the module a step
        calls, the optimizer, scheduler, loss and metrics; then the run's state."""
        spec, creators = self.spec, self.creators
        ingested, self.ingested = self.ingested, None  # the agreed rows hold them from here on
        if ingested is None:
            raise RuntimeError("a Trainer runs one fit: make another for the next")
        started = time.perf_counter()
        with self._stage.at("collective"):
            self.rows = agree_on_rows(ingested, spec, self.ranks, resume.shards if resume is not None else None)
        laid = time.perf_counter()
        self.phases["layout"] = laid - started
        self.feed = Feed(spec.schema, self.device, spec.batch_size, self.rows.train_rows)
        torch.manual_seed(spec.seed)
        model = self.model = creators.build_model().to(self.device)
        strategy = self.strategy = for_spec(spec, self.ranks)
        strategy.load_weights(model, resume)
        output_shape = self._shape_labels(model)
        self.precision = Precision(spec.precision, self.device)
        wrapped = strategy.wrap(model, resumed=resume is not None)
        self.ddp_model = self._compile(wrapped) if spec.compile_model else wrapped
        self.optimizer = creators.build_optimizer(model)
        strategy.attach(self.optimizer)
        made = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        self.scheduler = creators.build_scheduler(self.optimizer)
        self.loss_fn = Loss(creators.build_loss())
        metrics = MetricAccumulator(self.loss_fn, creators.metrics, self.device)
        self.validation = Validation(self.rows, self.feed, metrics, self.precision, strategy, self._stage, self._call)
        self.state = RunState(spec, self.ranks, self.rows, output_shape, made, self.scheduler, self.precision,
                              self.hooks, strategy)
        if resume is not None:
            self.state.restore(resume)
        self._batch_idx = max(self.state.progress.batch_in_epoch - 1, 0)
        self.phases["setup"] = time.perf_counter() - laid
        self._run_args.update(model=model, ddp_model=self.ddp_model, optimizer=self.optimizer,
                              scheduler=self.scheduler, loss_fn=self.loss_fn, scaler=self.precision.scaler)

    def _shape_labels(self, model: nn.Module) -> list[int]:
        """Runs the model on two rows (eval mode, no RNG drawn) to learn its output shape,
        and shapes the labels to match (see :meth:`AgreedRows.shape_labels`)."""
        was_training = model.training
        model.eval()
        with torch.no_grad():
            inputs = self.rows.train.slice(0, 2)[0]
            try:
                output_shape = list(self.feed.forward(model, self.feed.model_inputs(inputs)).shape[1:])
            except Exception as error:  # say what the model was given (the failure report adds notes)
                note = self.spec.schema.describe(inputs, self.spec.columns.features)
                error.__notes__ = [*getattr(error, "__notes__", ()), note]
                raise
        model.train(was_training)
        self.rows.shape_labels(output_shape, self.spec.columns.label, self.creators.loss_reads_labels_as_read)
        return output_shape

    def _compile(self, model: nn.Module) -> nn.Module:
        """The training module compiled (the DDP wrapper, as torch recommends). The model
        stays as it is: its state keeps plain keys (no ``_orig_mod.``), validation runs it
        uncompiled. One graph per batch shape (``dynamic=False``), so a resumed run equals an
        uninterrupted one. Each fit compiles afresh and logs its first step's time."""
        import torch._dynamo

        torch._dynamo.reset()
        for name in _PROFILER_LOGS:
            logging.getLogger(name).addFilter(_PROFILER_NOTICE)  # once: a logger keeps a filter once
        self._compiling = True
        return cast(nn.Module, torch.compile(model, dynamic=False))  # compiling a module gives a module

    # ------------------------------------------------------------------------ steps

    def _default_step(self, batch: Batch, samples: int, share: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss, backward and optimizer step, with the hooks between them.

        ``share``: this rank's rows of the step times the ranks, over the step's rows. The
        gradient is the ranks' mean, so a rank's loss counts ``share`` times: an uneven
        step (the short last one, or rows the ranks cannot split evenly) gets the gradient
        of the mean over all its rows, as one process would. A rank with no rows in the
        step still runs the model (on no rows) and backward, with a zero loss."""
        with self.precision.autocast():
            with self._stage.at("forward"):
                self.optimizer.zero_grad(set_to_none=True)
                outputs = self.feed.forward(self.ddp_model, batch.inputs)
            with self._stage.at("loss"):
                loss = (scalar_loss(self.loss_fn(outputs, batch.labels, batch.weights), self.loss_fn)
                        if len(batch.labels) else zero_through(self.ddp_model))
        replaced = self._call("before_backward", batch, outputs=outputs, loss=loss)
        if replaced is not None:
            # A constant loss still runs backward through the parameters (not the outputs,
            # which may be NaN), so DDP's gradient all-reduce happens on every rank and the
            # step simply has zero gradients.
            loss = replaced if replaced.requires_grad else replaced + zero_through(self.ddp_model)
        with self._stage.at("backward"):
            self.precision.backward(loss if share == 1 else loss * share)
            self.precision.unscale(self.optimizer)  # hooks see (and clip) the true gradients
        self._call("after_backward", batch, outputs=outputs, loss=loss)
        self._call("before_optimizer_step", batch, outputs=outputs, loss=loss)
        with self._stage.at("optimizer_step"):
            self.precision.step(self.optimizer)
        self.state.step_done(samples)
        self._call("after_optimizer_step", batch, outputs=outputs, loss=loss)
        return loss, outputs

    def _hook_step(self, batch: Batch, samples: int) -> tuple[Any, torch.Tensor | None]:
        """The ``train_step`` of a hook in place of the default step: ``(loss, outputs)``."""
        with self._stage.at("train_step"), self.precision.autocast():
            result = self.hooks.run_train_step(self._arguments(batch, model=self.ddp_model))
            loss, outputs = result if isinstance(result, tuple) else (result, None)
        self.state.step_done(samples)
        return loss, outputs

    def _report_compile(self, seconds: float) -> None:
        """Reports the first compiled step's time once per fit, from rank 0, in the driver's log."""
        self._compiling = False
        if self.ranks.rank == 0:
            note = f"compileModel: the first step, compiling the model, took {seconds:.1f}s"
            logger.info("rank 0: %s", note)
            self.reporter.note(__name__, note)

    # ------------------------------------------------------------------------ losses

    def _keep_loss(self, batch: Batch, loss: Any, position: int) -> bool:
        """Keeps the step's loss on the device for the epoch's mean (weighted by the rows'
        weights); returns whether the kept losses are due to be read."""
        with self._stage.at("loss"):
            loss = scalar_loss(loss, self.loss_fn)
        if not len(batch.labels):  # no row of this rank in the step: nothing to count (a hook's loss on no rows is NaN)
            loss = torch.zeros_like(loss.detach())
        elif self.hooks.train_step is not None:
            loss = loss.detach().clone()  # the hook's tensor, which it may change in place later
        rows = batch.weights.sum() if batch.weights is not None else len(batch.labels)
        return self._losses.add(loss, rows, self.state.progress, self._batch_idx, position)

    def _read_losses(self) -> None:
        """Reads the losses kept since the last reading on the host, at once: a NaN or
        infinite one fails the fit naming its step (unless ``allowNonFinite``); the others
        join the epoch's mean, and rank 0 reports the last to the driver."""
        if not len(self._losses):
            return
        with self._stage.at("loss"):
            steps = self._losses.read()
            for step in steps:
                if not math.isfinite(step.value) and not self.spec.allow_non_finite:
                    raise self._non_finite(step)
                self.state.add_loss(step.value, step.rows)
        self.reporter.step(steps[-1].progress, steps[-1].value, self.rows.steps_per_epoch)

    def _non_finite(self, step: StepLoss) -> Exception:
        """The error of the non-finite loss of ``step``, naming the columns of its rows (as the
        table holds them) that hold NaN or infinite values."""
        inputs, labels, weights = self._epoch_rows.take(step.position)
        batch = Batch(self.spec.schema.model_inputs(inputs), labels, weights)
        progress = step.progress
        return non_finite_loss(step.value, batch, self.spec.schema, self.spec.columns.label,
                               f"epoch {progress.epoch + 1}, batch {step.batch_idx} (global step "
                               f"{progress.global_step}) on rank {self.ranks.rank}")

    # ------------------------------------------------------------ end of an epoch

    def _end_epoch(self) -> None:
        """The epoch's history entry (with validation), its hooks, scheduler step and checkpoint."""
        with self._stage.at("collective"):
            entry = self.state.epoch_entry()
        if self.rows.val_rows:
            entry.update(self.validation.run(self.model))
        self.state.end_epoch(entry)
        self._call("after_train_epoch", metrics=entry)  # hooks may add to the entry
        self.reporter.epoch(entry)
        if self.scheduler is not None and self.control.step_scheduler_per_epoch:
            with self._stage.at("scheduler_step"):
                self.scheduler.step()
        self._ask_driver_to_go_on(entry["epoch"])
        self._agree_on_flags()
        self._checkpoint_if_due("ep")
        logger.info("rank %d: epoch %d %s", self.ranks.rank, entry["epoch"], format_entry(entry))

    # --------------------------------------------------------- hooks, flags, checkpoints

    def _arguments(self, batch: Batch | None = None, **extra: Any) -> dict[str, Any]:
        """Every argument on offer now: the run's objects, the progress as it is, the batch,
        and the stage's extras."""
        progress = self.state.progress if hasattr(self, "state") else Progress()
        return {**self._run_args, "epoch": progress.epoch, "global_step": progress.global_step, "state": progress,
                "batch_idx": self._batch_idx, **(batch.arguments() if batch is not None else {}), **extra}

    def _call(self, stage: str, batch: Batch | None = None, **extra: Any) -> Any:
        """Calls every hook's ``stage``; returns the last value one of them returned."""
        if not self.hooks.has(stage):
            return None
        with self._stage.at(stage):
            return self.hooks.call(stage, self._arguments(batch, **extra))

    def _agree_on_flags(self) -> None:
        """Combines stop requests of all ranks so every rank stops at the same step."""
        if not self._sync_flags:
            return
        with self._stage.at("collective"):
            flags = torch.tensor([self.control.stop_training, self.control.stop_epoch], dtype=torch.int32)
            stop_training, stop_epoch = self.ranks.all_reduce(flags, dist.ReduceOp.MAX).tolist()
        self.control.stop_training, self.control.stop_epoch = bool(stop_training), bool(stop_epoch)

    def _ask_driver_to_go_on(self, epoch: int) -> None:
        """Rank 0 asks whether a driver-side logger stops the fit at the end of ``epoch``
        (when one may, and the fit goes on after it); the flag agreement that follows tells
        every rank."""
        wait = self.spec.stop_wait_s
        if wait is None or self.spec.target.reached(self.state.progress):
            return
        if self.reporter.stop_asked(epoch, wait):
            logger.info("rank %d: a logger on the driver stops the fit after epoch %d", self.ranks.rank, epoch)
            self.control.stop_training = True

    def _on_exception(self, error: BaseException) -> None:
        if not self.hooks.has("on_exception"):
            return
        failed_hook = self.hooks.current_hook
        try:
            self.hooks.call("on_exception", self._arguments(exception=error, stage=self.stage))
        except Exception:  # the original error is the one to report
            logger.exception("rank %d: an on_exception hook raised", self.ranks.rank)
        self.hooks.current_hook = failed_hook

    def _checkpoint_if_due(self, unit: str) -> None:
        """Writes a periodic checkpoint when one is due after this ``unit`` ("ep" or "ba"),
        once the losses kept so far are read: a non-finite one fails the fit first."""
        if not self.state.checkpoint_due(unit):
            return
        self._read_losses()
        with self._stage.at("checkpoint"):
            self.state.write_checkpoint()
