"""[executor] The training loop of one rank: resume, DDP, equal steps, hooks, validation,
checkpoint.

Hook arguments come from one place per scope: the run's objects are fixed in
``_setup``; epoch, ``global_step`` and ``state`` are read from ``self.progress`` (advanced
right after each optimizer step) whenever a stage is called; a step's batch, outputs and
loss live in that step's own dict. So every stage sees the loop as it is.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spark_torch_est import rng
from spark_torch_est.balance import rebalance, transfer_plan
from spark_torch_est.channel import ProgressReporter
from spark_torch_est.checkpoint import Checkpoint, check_compatible
from spark_torch_est.columns import DenseRows
from spark_torch_est.creators import Creators
from spark_torch_est.data import (LAYOUT_SIZE, TORCH_DTYPES, EpochPlan, Shard, Table, agree, conform, epoch_order,
                                  layout, shape_labels)
from spark_torch_est.errors import IncompatibleCheckpointError, InputDataError
from spark_torch_est.hooks import Control, HookSet
from spark_torch_est.losses import Loss
from spark_torch_est.metrics import MetricAccumulator
from spark_torch_est.precision import Precision
from spark_torch_est.prefetch import prefetch, transfer_for
from spark_torch_est.schema import FEATURES_LAYOUT
from spark_torch_est.sharding import ShardedState, full_model_state, shard_model
from spark_torch_est.progress import Progress
from spark_torch_est.spec import TaskSpec
from spark_torch_est.storage import CheckpointDir

__all__ = ["Trainer", "NonFiniteLossError"]

logger = logging.getLogger(__name__)

_ONE_ROW_BATCH_NORM = "Expected more than 1 value per channel when training"


class NonFiniteLossError(ArithmeticError):
    """The loss became NaN or infinite (see the ``allowNonFinite`` Param)."""


class Trainer:
    """Runs one fit on one rank; every rank runs the same collectives in the same order.

    Args:
        creators: The user's creators and hooks, unpickled on this rank.
        spec: The fit's description.
        shard: This rank's rows.
        rank: This rank.
        world_size: Number of ranks.
        device: Where the model lives.
        reporter: Sends progress to the driver (rank 0); None sends nothing.

    Attributes:
        stage: The stage running now, reported if something raises.
        hooks: The fit's hooks (``hooks.current_hook`` names a hook while it runs).
    """

    def __init__(self, creators: Creators, spec: TaskSpec, shard: Shard, rank: int,
                 world_size: int, device: torch.device, reporter: ProgressReporter | None = None) -> None:
        self.creators = creators
        self.spec = spec
        self.shard = shard
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.reporter = reporter or ProgressReporter(None, rank)
        self.stage = "setup"
        self.hooks = HookSet(creators.hooks)
        self.control = Control()
        self.progress = Progress()
        self._last_batch_idx = 0
        self._run_args: dict[str, Any] = {"rank": rank, "world_size": world_size, "control": self.control,
                                          "device": device, "config": dict(creators.config)}
        self._sync_flags = world_size > 1 and bool(self.hooks)
        self._sync_step_flags = world_size > 1 and self.hooks.controls_steps
        self._transfer = transfer_for(device)
        self._compiling = False  # until the first step of a compiled model has run

    # ----------------------------------------------------------------- public entry

    def run(self) -> bytes | None:
        """Trains to the spec's target; returns the checkpoint bytes on rank 0, else None."""
        resume = Checkpoint.from_bytes(self.spec.resume) if self.spec.resume is not None else None
        try:
            self._setup(resume)
            self._call("before_run", self._last_batch_idx)
            if resume is not None:
                rng.restore(resume.rng_states[self.rank % len(resume.rng_states)], self.device)
            else:
                rng.seed_all(self.spec.seed, self.rank)
            self._agree_on_flags()
            self._train()
            self._call("after_run", self._last_batch_idx, metrics=self.history[-1] if self.history else {})
        except BaseException as error:
            self._on_exception(error)
            raise
        return self._result()

    # ----------------------------------------------------------------------- setup

    def _setup(self, resume: Checkpoint | None) -> None:
        spec, creators = self.spec, self.creators
        self._agree_on_rows()
        torch.manual_seed(spec.seed)
        model = creators.build_model().to(self.device)
        if resume is not None and resume.sharded is None:
            check_compatible(model.state_dict(), resume.model_state)
            model.load_state_dict(resume.model_state)
        self.output_shape = self._shape_labels(model)
        self.precision = Precision(spec.precision, self.device)
        self.model = model
        self.ddp_model: nn.Module = model
        if spec.strategy == "fsdp":
            shard_model(model, spec.shard_modules, self.device)
        elif self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            # Resumed, every rank has just loaded the same checked state: DDP's broadcast of
            # all parameters and buffers from rank 0 would only copy it again (~0.5 s for 200 MB).
            skip_sync = resume is not None and "init_sync" in inspect.signature(DistributedDataParallel).parameters
            self.ddp_model = DistributedDataParallel(model, device_ids=ids,
                                                     **({"init_sync": False} if skip_sync else {}))
        if spec.compile_model:
            self.ddp_model = self._compile(self.ddp_model)
        self.optimizer = creators.build_optimizer(model)
        self.optimizer_made = [{k: v for k, v in group.items() if k != "params"}
                               for group in self.optimizer.param_groups]
        self.sharded = (ShardedState(model, self.optimizer, self.rank, self.world_size)
                        if spec.strategy == "fsdp" else None)
        self._pointer = resume.sharded if resume is not None else None  # the newest sharded checkpoint of the run
        self._pointer_step = resume.progress.global_step if resume is not None else -1
        self.scheduler = creators.build_scheduler(self.optimizer)
        self.loss_fn = Loss(creators.build_loss())
        self.val_metrics = MetricAccumulator(self.loss_fn, creators.metrics, self.device)
        self.progress = resume.progress if resume is not None else Progress()
        self.history: list[dict] = resume.history if resume is not None else []
        carried = self.rank == 0 and self.progress.batch_in_epoch > 0
        self.loss_sum, self.loss_count = resume.partial_loss if carried else (0.0, 0.0)
        if resume is not None:
            self._restore(resume)
        self._offset = self._resume_offset(resume)
        self._last_batch_idx = max(self.progress.batch_in_epoch - 1, 0)
        self._run_args.update(model=model, ddp_model=self.ddp_model, optimizer=self.optimizer,
                              scheduler=self.scheduler, loss_fn=self.loss_fn, scaler=self.precision.scaler)

    def _compile(self, model: nn.Module) -> nn.Module:
        """The training module compiled (``torch.compile`` of the DDP wrapper, as torch
        recommends, or of the model on one rank). The model itself stays as it is, so its
        state keeps its plain keys (no ``_orig_mod.``), and validation runs it uncompiled.
        One graph per batch shape (``dynamic=False``): the kernels a step runs do not
        depend on the shapes seen before, so a resumed run equals an uninterrupted one.
        Each fit compiles afresh; its first step's time is logged (see :meth:`_train_step`)."""
        import torch._dynamo

        torch._dynamo.reset()
        self._compiling = True
        return torch.compile(model, dynamic=False)

    def _restore(self, resume: Checkpoint) -> None:
        """Loads the optimizer, scheduler and hook states of the run. A hyper-parameter the
        optimizer creator now makes differently (a new config) takes its new value; the
        others keep the run's, as a scheduler left them. Hooks added since keep their own
        state."""
        if self.sharded is not None:
            if resume.sharded is None:
                raise IncompatibleCheckpointError('strategy="fsdp" resumes from a sharded checkpoint; this one '
                                                  f"holds the whole state (strategy={resume.strategy!r})")
            self.sharded.load(resume.sharded)
        else:
            self.optimizer.load_state_dict(resume.optimizer_state)
        self.precision.load_state_dict(resume.scaler_state)
        if self.scheduler is not None and resume.scheduler_state is not None:
            self.scheduler.load_state_dict(resume.scheduler_state)
        for group, made, before in zip(self.optimizer.param_groups, self.optimizer_made, resume.optimizer_made):
            group.update({key: value for key, value in made.items() if not _same(before.get(key, value), value)})
        self.hooks.load_state_dict({name: state for name, state in resume.hook_states.items()
                                    if name not in self.spec.fresh_hooks})

    def _shape_labels(self, model: nn.Module) -> list[int]:
        """Runs the model on two rows (eval mode, no RNG drawn) to learn its output shape,
        and shapes the labels to match (see :func:`data.shape_labels`)."""
        was_training = model.training
        model.eval()
        with torch.no_grad():
            inputs, _, _ = self.train.slice(0, 2)
            try:
                output_shape = list(self._forward(self._on_device(inputs), model).shape[1:])
            except Exception as error:  # say what the model was given (the failure report adds notes)
                error.__notes__ = [*getattr(error, "__notes__", ()), self._inputs_text(inputs)]
                raise
        model.train(was_training)
        for table in (self.train, self.validation):
            table.labels = DenseRows(shape_labels(table.labels.tensor, output_shape, self.spec.columns.label))
        return output_shape

    def _inputs_text(self, inputs: list[torch.Tensor]) -> str:
        """What the model's first forward was given, in the user's column names."""
        schema, feature_cols = self.spec.schema, self.spec.columns.features
        if schema.layout == FEATURES_LAYOUT:
            width = math.prod(inputs[0].shape[1:])
            source = f"featureCols {list(feature_cols)}" if feature_cols else f"featuresCol {schema.columns[0].name!r}"
            return f"the model was given {width} features per row ({source}): a batch of shape {tuple(inputs[0].shape)}"
        given = ", ".join(f"{c.name!r}: {str(t.dtype).replace('torch.', '')} {tuple(t.shape)}"
                          for c, t in zip(schema.columns, inputs))
        return f"the model was called as model(*inputs) with inputCols {given}"

    def _agree_on_rows(self) -> None:
        """Shares every rank's row counts and column layouts, gives each column one layout
        on all ranks (arrays padded per batch where lengths differ), evens the training
        rows out (see :mod:`balance`), and fixes the steps per epoch all ranks take."""
        self.stage = "collective"
        schema, columns = self.spec.schema, self.spec.columns
        tables = (self.shard.train, self.shard.validation)
        width = len(schema.columns) + 1 + (columns.weight is not None)
        info = torch.zeros(self.world_size, 2, 2 + width * LAYOUT_SIZE, dtype=torch.int64)
        for role, table in enumerate(tables):
            info[self.rank, role, 0] = len(table) if table is not None else 0
            for c, rows in enumerate(table.columns() if table is not None else [None] * width):
                info[self.rank, role, 2 + c * LAYOUT_SIZE:2 + (c + 1) * LAYOUT_SIZE] = torch.tensor(layout(rows))
        info = self._all_reduce(info, dist.ReduceOp.SUM)
        self.train_rows = [int(n) for n in info[:, 0, 0]]
        self.val_rows = int(info[:, 1, 0].sum())
        names = [f"featuresCol {c.name!r}" if schema.layout == FEATURES_LAYOUT else f"inputCols column {c.name!r}"
                 for c in schema.columns] + [f"labelCol {columns.label!r}", f"weightCol {columns.weight!r}"]
        agreed = [agree(info[:, :, 2 + c * LAYOUT_SIZE:2 + (c + 1) * LAYOUT_SIZE].reshape(-1, LAYOUT_SIZE), names[c],
                        may_be_ragged=schema.layout != FEATURES_LAYOUT and c < len(schema.columns))
                  for c in range(width)]
        dtypes = [TORCH_DTYPES[c.dtype] for c in schema.columns]
        dtypes += [torch.int64 if agreed[len(schema.columns)].integer else torch.float32, torch.float32]
        count = len(schema.columns)

        def conformed(table: Table | None) -> Table:
            rows = table.columns() if table is not None else [None] * width
            done = [conform(r, a, d, schema.padding_value) for r, a, d in zip(rows, agreed, dtypes)]
            return Table(done[:count], done[count], done[count + 1] if columns.weight is not None else None)

        self.train, self.validation = conformed(tables[0]), conformed(tables[1])
        self.shard = None  # the tables above hold the rows from here on
        for column, rows in zip(schema.columns, self.train.inputs):
            if column.shape is not None:
                if rows.row_shape is None:
                    raise InputDataError(f"inputShapes[{column.name!r}] needs rows of one size, but column "
                                         f"{column.name!r} holds arrays of different lengths")
                column.check_row_size(math.prod(rows.row_shape))
        plan = transfer_plan(self.train_rows)
        if plan:
            self.train = rebalance(self.train, plan, self.rank, self.device)
            logger.info("rank %d: evened out %s training rows per rank", self.rank, self.train_rows)
            for source, destination, rows in plan:
                self.train_rows[source] -= rows
                self.train_rows[destination] += rows
        empty = [r for r, n in enumerate(self.train_rows) if n == 0]
        if empty:
            raise InputDataError(
                f"rank(s) {empty} received no training rows (rows per rank: {self.train_rows}); "
                "give the DataFrame at least numWorkers training rows, or lower numWorkers"
            )
        self.stage = "setup"
        self.steps_per_epoch = EpochPlan(self.train_rows, self.spec.batch_size).steps

    @property
    def _data_source(self) -> str:
        return self.spec.source.digest if self.spec.source is not None else "spark"

    def _resume_offset(self, resume: Checkpoint | None) -> int:
        """Rows of its order each rank already trained on in the current epoch.

        The position is kept in samples, so a changed ``batchSize`` continues the epoch
        exactly where it stopped. With other data or another ``numWorkers`` the rows and
        orders differ: the epoch then continues from the same fraction of its rows.
        """
        progress = self.progress
        if resume is None or progress.sample_in_epoch == 0:
            return 0
        rows = sum(self.train_rows)
        if (resume.epoch_rows, resume.world_size, resume.data_source) == (rows, self.world_size, self._data_source):
            return progress.sample_in_epoch // self.world_size
        fraction = progress.sample_in_epoch / max(resume.epoch_rows, 1)
        offset = min(int(fraction * max(self.train_rows)), max(self.train_rows) - 1)
        if self.rank == 0:
            def read(source: str) -> str:
                return "read through Spark" if source == "spark" else "read from the table's files"

            logger.warning(
                "the epoch in progress began with %d training rows on %d workers (%s) and continues with %d rows on "
                "%d (%s): it goes on from the same fraction (%.1f%%) of each worker's rows", resume.epoch_rows,
                resume.world_size, read(resume.data_source), rows, self.world_size, read(self._data_source),
                100 * fraction)
        return offset

    # ------------------------------------------------------------------- training

    def _train(self) -> None:
        self.model.train()
        while not (self.control.stop_training or self.spec.target.reached(self.progress)):
            self.control.stop_epoch = False
            if self.progress.batch_in_epoch == 0:
                self._call("before_train_epoch", 0)
                if self.hooks.has("before_train_epoch"):  # else the flags are as last combined
                    self._agree_on_flags()
                if self.control.stop_training:  # asked before the epoch's first step: none of it runs
                    break
            if self._train_epoch():
                self._end_epoch()

    def _train_epoch(self) -> bool:
        """Runs batches until the epoch ends (True) or the fit must stop mid-epoch (False)."""
        spec = self.spec
        plan = EpochPlan(self.train_rows, spec.batch_size, self._offset)
        order = epoch_order(len(self.train), spec.seed, self.progress.epoch, self.rank)
        batches = prefetch((self.train.take(plan.positions(order, step)) for step in range(plan.steps)), self._transfer)
        for step in range(plan.steps):
            if spec.target.reached(self.progress):
                return False
            self._train_step(*next(batches), plan.samples(step))
            self._maybe_write_checkpoint("ba")
            if self._sync_step_flags:
                self._agree_on_flags()
            if self.control.stop_training:
                return step == plan.steps - 1
            if self.control.stop_epoch:
                return True
        return True

    def _on_device(self, inputs: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """A batch's inputs as the model takes them: one tensor (``featuresCol`` /
        ``featureCols``) or a tuple in ``inputCols`` order, reshaped by ``inputShapes``."""
        moved = tuple(x.to(self.device, non_blocking=True).reshape(len(x), *column.shape)
                      if column.shape is not None else x.to(self.device, non_blocking=True)
                      for x, column in zip(inputs, self.spec.schema.columns))
        return moved[0] if self.spec.schema.layout == FEATURES_LAYOUT else moved

    def _batch(self, inputs: list[torch.Tensor], labels: torch.Tensor, weights: torch.Tensor | None) -> dict[str, Any]:
        """A batch's hook arguments, on the rank's device."""
        inputs = self._on_device(inputs)
        labels = labels.to(self.device, non_blocking=True)
        weights = weights.to(self.device, non_blocking=True) if weights is not None else None
        return {"batch": (inputs, labels), "inputs": inputs, "labels": labels, "weights": weights}

    def _train_step(self, inputs: list[torch.Tensor], labels: torch.Tensor, weights: torch.Tensor | None,
                    samples: int) -> None:
        batch_idx = self._last_batch_idx = self.progress.batch_in_epoch
        started = time.perf_counter()
        step = self._batch(inputs, labels, weights)
        replaced = self._call("before_train_iter", batch_idx, **step)
        if replaced is not None:
            step.update(batch=tuple(replaced), inputs=replaced[0], labels=replaced[1])
        if self.hooks.train_step is not None:
            self.stage = "train_step"
            with self.precision.autocast():
                result = self.hooks.run_train_step(self._arguments(batch_idx, step, model=self.ddp_model))
            loss, outputs = result if isinstance(result, tuple) else (result, None)
            self.progress = self.progress.to_next_batch(samples)
        else:
            loss, outputs = self._default_step(batch_idx, step, samples)
        step.update(outputs=outputs, loss=loss)
        if self._compiling:
            self._report_compile(time.perf_counter() - started)
        self._account(batch_idx, step)
        self._call("after_train_iter", batch_idx, **step)
        self.reporter.step(self.progress, loss.detach(), self.steps_per_epoch)

    def _report_compile(self, seconds: float) -> None:
        """Reports the first compiled step's time once per fit, from rank 0, in the driver's log."""
        self._compiling = False
        if self.rank == 0:
            note = f"compileModel: the first step, compiling the model, took {seconds:.1f}s"
            logger.info("rank 0: %s", note)
            self.reporter.note(__name__, note)

    def _default_step(self, batch_idx: int, step: dict[str, Any], samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.stage = "forward"
        self.optimizer.zero_grad(set_to_none=True)
        with self.precision.autocast():
            outputs = self._forward(step["inputs"])
            self.stage = "loss"
            loss = _scalar_loss(self.loss_fn(outputs, step["labels"], step["weights"]))
        step.update(outputs=outputs, loss=loss)
        replaced = self._call("before_backward", batch_idx, **step)
        if replaced is not None:
            # A constant loss still runs backward through the parameters (not the outputs,
            # which may be NaN), so DDP's gradient all-reduce happens on every rank and the
            # step simply has zero gradients.
            loss = step["loss"] = replaced if replaced.requires_grad else replaced + _zero_through(self.ddp_model)
        self.stage = "backward"
        self.precision.backward(loss)
        self.precision.unscale(self.optimizer)  # hooks see (and clip) the true gradients
        self._call("after_backward", batch_idx, **step)
        self._call("before_optimizer_step", batch_idx, **step)
        self.stage = "optimizer_step"
        self.precision.step(self.optimizer)
        self.progress = self.progress.to_next_batch(samples)  # the step is done from here on
        self._call("after_optimizer_step", batch_idx, **step)
        return loss, outputs

    def _forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...], model: nn.Module | None = None) -> torch.Tensor:
        """The model on one batch: ``model(features)`` or ``model(*inputs)``."""
        model = model if model is not None else self.ddp_model
        try:
            return model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        except IndexError as error:  # an id past an embedding's table says nothing of where it came from
            if "index out of range" not in str(error):
                raise
            tensors = inputs if isinstance(inputs, tuple) else (inputs,)
            ids = [(c.name, x) for c, x in zip(self.spec.schema.columns, tensors) if x.dtype == torch.int64 and x.numel()]
            if not ids:
                raise
            ranges = ", ".join(f"{name!r} holds {int(x.min())}..{int(x.max())}" for name, x in ids)
            raise IndexError(f"{error}: an id is out of an embedding's range; in this batch {ranges} (an nn.Embedding "
                             "of n rows takes ids 0..n-1)") from None
        except ValueError as error:
            rows = len(inputs[0] if isinstance(inputs, tuple) else inputs)
            if _ONE_ROW_BATCH_NORM not in str(error) or rows != 1:
                raise
            raise ValueError(
                f"{error}: a batch of this epoch has a single row (batchSize={self.spec.batch_size}, training rows "
                f"per worker {self.train_rows}), and BatchNorm cannot train on one row. Choose a batchSize that "
                "leaves more than one row in the last batch of each worker"
            ) from None

    def _account(self, batch_idx: int, step: dict[str, Any]) -> None:
        """Adds the step's loss to the epoch's mean (weighted by the rows' weights); a NaN or
        infinite loss fails the fit (unless ``allowNonFinite``), before it can reach a
        checkpoint."""
        self.stage = "loss"
        value = float(_scalar_loss(step["loss"]).detach())
        if not math.isfinite(value) and not self.spec.allow_non_finite:
            inputs = step["inputs"] if isinstance(step["inputs"], tuple) else (step["inputs"],)
            named = [(f"column {c.name!r}", x) for c, x in zip(self.spec.schema.columns, inputs)]
            named.append((f"labelCol {self.spec.columns.label!r}", step["labels"]))
            bad = [name for name, tensor in named
                   if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
                   and not bool(torch.isfinite(tensor).all())]
            raise NonFiniteLossError(
                f"non-finite loss ({value}) at epoch {self.progress.epoch + 1}, batch {batch_idx} (global step "
                f"{self.progress.global_step}) on rank {self.rank}: "
                + (f"the batch's {' and '.join(bad)} hold NaN or infinite values" if bad else
                   "the model diverged (lower the learning rate, clip gradients)")
                + "; set allowNonFinite=True to train on regardless"
            )
        weights = step["weights"]
        rows = float(weights.sum()) if weights is not None else len(step["labels"])
        self.loss_sum += value * rows
        self.loss_count += rows

    def _end_epoch(self) -> None:
        self.stage = "collective"
        totals = self._all_reduce(torch.tensor([self.loss_sum, self.loss_count], dtype=torch.float64),
                                  dist.ReduceOp.SUM)
        mean = float(totals[0] / totals[1]) if float(totals[1]) else float("nan")  # NaN: all weights were 0
        entry: dict[str, Any] = {"epoch": self.progress.epoch + 1, "train_loss": mean, "world_size": self.world_size}
        self.loss_sum, self.loss_count = 0.0, 0.0
        if self.val_rows:
            entry.update(self._validate())
        self.progress = self.progress.to_next_epoch()
        self._offset = 0
        self.history.append(entry)
        self._call("after_train_epoch", self._last_batch_idx, metrics=entry)  # hooks may add to the entry
        self.reporter.epoch(entry)
        if self.scheduler is not None and self.control.step_scheduler_per_epoch:
            self.stage = "scheduler_step"
            self.scheduler.step()
        self._agree_on_flags()
        self._maybe_write_checkpoint("ep")
        logger.info("rank %d: epoch %d %s", self.rank, entry["epoch"],
                    " ".join(f"{k}={v:.6g}" for k, v in entry.items() if k != "epoch"))

    # ----------------------------------------------------------------- validation

    def _validate(self) -> dict[str, float]:
        """Loss and metrics over every rank's validation rows, weighted by rows (or by
        their weights)."""
        self._call("before_val_epoch", self._last_batch_idx)
        self.stage = "validation"
        model, table, size, metrics = self.model, self.validation, self.spec.batch_size, self.val_metrics
        metrics.reset()
        model.eval()
        starts = range(0, len(table), size)
        most = self._most_batches(len(starts)) if self.sharded is not None else len(starts)
        with torch.no_grad():
            for start, batch in zip(starts, prefetch((table.slice(s, s + size) for s in starts), self._transfer)):
                step = self._batch(*batch)
                self._call("before_val_iter", start // size, **step)
                self.stage = "validation"
                with self.precision.autocast():
                    outputs = self._forward(step["inputs"], model)
                    step.update(outputs=outputs, loss=metrics.update(outputs, step["labels"], step["weights"]))
                self._call("after_val_iter", start // size, **step)
                self.stage = "validation"
            self._extra_forwards(most - len(starts))
        model.train()
        self.stage = "collective"
        results = metrics.results(self._all_reduce(metrics.totals(), dist.ReduceOp.SUM))
        values = {f"val_{name}": value for name, value in results.items()}
        self._call("after_val_epoch", self._last_batch_idx, metrics=values)  # hooks may add to the entry
        return values

    def _most_batches(self, batches: int) -> int:
        """The most validation batches of any rank: under "fsdp" every rank makes that many
        forward passes, since each pass gathers the parameters from every rank."""
        self.stage = "collective"
        most = int(self._all_reduce(torch.tensor([batches], dtype=torch.int64), dist.ReduceOp.MAX)[0])
        self.stage = "validation"
        return most

    def _extra_forwards(self, count: int) -> None:
        """Runs the model ``count`` times on one training row, dropping the outputs (see
        :meth:`_most_batches`)."""
        inputs = self._on_device(self.train.slice(0, 1)[0]) if count > 0 else None
        for _ in range(count):
            with self.precision.autocast():
                self._forward(inputs, self.model)

    # -------------------------------------------------------------- hooks, flags

    def _arguments(self, batch_idx: int, step: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        """Every argument on offer now: the run's objects, the progress as it is, the
        step's batch and results, and the stage's extras."""
        progress = self.progress
        return {**self._run_args, "epoch": progress.epoch, "global_step": progress.global_step, "state": progress,
                "batch_idx": batch_idx, **(step or {}), **extra}

    def _call(self, stage: str, batch_idx: int, **extra: Any) -> Any:
        if not self.hooks.has(stage):
            return None
        self.stage = stage
        return self.hooks.call(stage, self._arguments(batch_idx, None, **extra))

    def _agree_on_flags(self) -> None:
        """Combines stop requests of all ranks so every rank stops at the same step."""
        if not self._sync_flags:
            return
        self.stage = "collective"
        flags = torch.tensor([self.control.stop_training, self.control.stop_epoch], dtype=torch.int32)
        flags = self._all_reduce(flags, dist.ReduceOp.MAX)
        self.control.stop_training, self.control.stop_epoch = bool(flags[0]), bool(flags[1])

    def _on_exception(self, error: BaseException) -> None:
        if not self.hooks.has("on_exception"):
            return
        failed_stage, failed_hook = self.stage, self.hooks.current_hook
        try:
            self.hooks.call("on_exception", self._arguments(self._last_batch_idx, exception=error, stage=failed_stage))
        except Exception:  # the original error is the one to report
            logger.exception("rank %d: an on_exception hook raised", self.rank)
        self.stage, self.hooks.current_hook = failed_stage, failed_hook

    # ---------------------------------------------------------------- collectives

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        on_device = tensor.to(self.device)
        dist.all_reduce(on_device, op=op)
        return on_device.cpu()

    def _gather_rng_states(self) -> list[torch.Tensor]:
        """Every rank's RNG state, gathered as tensors and checked (nothing is unpickled)."""
        state = rng.capture(self.device)
        if self.world_size == 1:
            return [state]
        lengths = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(lengths, torch.tensor([len(state)], device=self.device))
        longest = int(max(int(n) for n in lengths))
        padded = torch.zeros(longest, dtype=torch.float64, device=self.device)
        padded[:len(state)] = state.to(self.device)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        states = [g[:int(n)].cpu() for g, n in zip(gathered, lengths)]
        for peer, peer_state in enumerate(states):
            try:
                rng.check(peer_state)
            except ValueError as error:
                raise ValueError(f"rank {peer} sent a malformed RNG state: {error}") from None
        return states

    # ---------------------------------------------------------------- checkpoints

    def _maybe_write_checkpoint(self, unit: str) -> None:
        every = self.spec.checkpoint_every
        if self.spec.checkpoint_dir is None or every is None or every[1] != unit:
            return
        count = self.progress.epoch if unit == "ep" else self.progress.global_step
        if count % every[0]:
            return
        if self.sharded is not None:
            self._write_sharded()
            return
        blob = self._checkpoint_bytes()
        if blob is not None:
            started = time.perf_counter()
            path = CheckpointDir(self.spec.checkpoint_dir, run_id=self.spec.run_id).write(
                blob, self.progress.epoch, self.progress.global_step)
            logger.info("rank 0: wrote %s (%.1f MB) in %.2fs", path, len(blob) / 1e6, time.perf_counter() - started)

    def _write_sharded(self) -> None:
        """Collective: every rank writes its part of the model and optimizer state, then rank 0
        writes the checkpoint that points at them (see :mod:`spark_torch_est.sharding`)."""
        self.stage = "checkpoint"
        started = time.perf_counter()
        directory = CheckpointDir(self.spec.checkpoint_dir, run_id=self.spec.run_id)
        self._pointer = self.sharded.save(directory.sharded_url(self.progress.epoch, self.progress.global_step))
        self._pointer_step = self.progress.global_step
        blob = self._checkpoint_bytes()
        if blob is not None:
            path = directory.write(blob, self.progress.epoch, self.progress.global_step)
            logger.info("rank 0: wrote %s and every rank's part in %.2fs", path, time.perf_counter() - started)

    def _result(self) -> bytes | None:
        """Collective: the checkpoint the driver keeps, on rank 0. Under "fsdp" it points at a
        sharded checkpoint of the state as it is now (written unless the last one is) and
        holds the full weights, gathered once here, for the fitted model."""
        if self.sharded is None:
            return self._checkpoint_bytes()
        if self._pointer_step != self.progress.global_step:
            self._write_sharded()
        self.stage = "checkpoint"
        return self._checkpoint_bytes(full_model_state(self.model))

    def _checkpoint_bytes(self, model_state: dict[str, torch.Tensor] | None = None) -> bytes | None:
        """Collective: gathers every rank's RNG state; rank 0 returns the serialized checkpoint.
        Under "fsdp" it holds ``model_state`` (the full weights, or none) and points at the
        newest sharded checkpoint for the rest."""
        self.stage = "checkpoint"
        states = self._gather_rng_states()
        partial = self._all_reduce(torch.tensor([self.loss_sum, self.loss_count], dtype=torch.float64),
                                   dist.ReduceOp.SUM)
        if self.rank != 0:
            return None
        if self.sharded is None:
            model_state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        model_state = model_state or {}
        broken = [k for k, v in model_state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if broken and not self.spec.allow_non_finite:  # a finite loss can still give NaN gradients
            raise NonFiniteLossError(
                f"the model's weights became NaN or infinite ({', '.join(broken[:5])}) by epoch "
                f"{self.progress.epoch + 1}, global step {self.progress.global_step}, although every loss was "
                "finite: a gradient was not (clip gradients, lower the learning rate, check sqrt/log/norm at 0); "
                "set allowNonFinite=True to keep such weights"
            )
        return Checkpoint.build(
            run_id=self.spec.run_id, fit_id=self.spec.fit_id, progress=self.progress, history=self.history,
            partial_loss=(float(partial[0]), float(partial[1])), epoch_rows=sum(self.train_rows),
            world_size=self.world_size, data_source=self._data_source, seed=self.spec.seed,
            optimizer_made=self.optimizer_made,
            output_shape=self.output_shape, label_kind="float" if self.train.labels.dtype.is_floating_point else "int",
            input_schema=self.spec.schema.to_dict(),
            input_rows=[list(c.shape) if c.shape is not None else list(rows.row_shape) if rows.row_shape is not None
                        else None for c, rows in zip(self.spec.schema.columns, self.train.inputs)],
            model=model_state,
            optimizer=_to_cpu(self.optimizer.state_dict()) if self.sharded is None else {},
            scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
            rng=states, hooks=self.hooks.state_dict(), precision=self.precision.name,
            scaler=self.precision.state_dict(), strategy=self.spec.strategy,
            sharded=self._pointer if self.sharded is not None else None,
        ).to_bytes()


def _zero_through(model: nn.Module) -> torch.Tensor:
    """A zero that every trainable parameter reaches, so backward gives each a zero gradient."""
    return sum((0.0 * p.sum() for p in model.parameters() if p.requires_grad), torch.zeros(()))


def _same(a: Any, b: Any) -> bool:
    """Whether two hyper-parameter values are equal (numbers, tuples or tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b


def _scalar_loss(loss: Any) -> torch.Tensor:
    """The loss as given, if it is a one-value tensor.

    Raises:
        TypeError: It is not (a Python number, a per-row tensor, ...).
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"the loss must be a tensor holding one value, got {shape}; reduce it (e.g. .mean()) "
                        "and return a tensor, not a Python number")
    return loss


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
