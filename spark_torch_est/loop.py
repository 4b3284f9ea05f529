"""The training loop of one rank: resume, DDP, equal steps, hooks, validation, checkpoint."""

from __future__ import annotations

import inspect
import io
import logging
import math
import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from spark_torch_est.balance import rebalance, transfer_plan
from spark_torch_est.channel import ProgressReporter
from spark_torch_est.checkpoint import FORMAT_VERSION, Checkpoint, check_compatible
from spark_torch_est.creators import Creators
from spark_torch_est.data import InputDataError, Shard, batch_positions, epoch_order, shape_labels
from spark_torch_est.hooks import Control, HookSet
from spark_torch_est.progress import Progress
from spark_torch_est.spec import TaskSpec
from spark_torch_est.storage import CheckpointDir

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)


class Trainer:
    """Runs one fit on one rank; every rank runs the same collectives in the same order.

    Args:
        creators: The user's creators and hooks, unpickled on this rank.
        spec: The job description.
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
        self.context: dict[str, Any] = {"rank": rank, "world_size": world_size, "control": self.control,
                                        "device": device, "config": dict(creators.config)}
        self._sync_flags = world_size > 1 and bool(self.hooks)
        self._sync_step_flags = world_size > 1 and self.hooks.controls_steps

    # ----------------------------------------------------------------- public entry

    def run(self) -> bytes | None:
        """Trains to the spec's target; returns the checkpoint bytes on rank 0, else None."""
        resume = Checkpoint.from_bytes(self.spec.resume) if self.spec.resume is not None else None
        try:
            self._setup(resume)
            self._call("before_run")
            self._restore_rng(resume)
            self._agree_on_flags()
            self._train()
            self._call("after_run", metrics=self.history[-1] if self.history else {})
        except BaseException as error:
            self._on_exception(error)
            raise
        self.stage = "checkpoint"
        return self._checkpoint_bytes()

    # ----------------------------------------------------------------------- setup

    def _setup(self, resume: Checkpoint | None) -> None:
        spec, creators = self.spec, self.creators
        self._agree_on_rows()
        torch.manual_seed(spec.seed)
        model = creators.build_model().to(self.device)
        if resume is not None:
            check_compatible(model.state_dict(), resume.model_state)
            model.load_state_dict(resume.model_state)
        self.output_shape = self._shape_labels(model)
        self.model = model
        self.ddp_model: nn.Module = model
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            # Resumed, every rank has just loaded the same checked state: DDP's broadcast of
            # all parameters and buffers from rank 0 would only copy it again (~0.5 s for 200 MB).
            skip_sync = resume is not None and "init_sync" in inspect.signature(DistributedDataParallel).parameters
            self.ddp_model = DistributedDataParallel(model, device_ids=ids, **({"init_sync": False} if skip_sync else {}))
        self.optimizer = creators.build_optimizer(model)
        self.scheduler = creators.build_scheduler(self.optimizer)
        self.loss_fn = creators.build_loss()
        self.metrics = {name: metric.to(self.device) if hasattr(metric, "to") else metric
                        for name, metric in creators.metrics.items()}
        self.progress = resume.progress if resume is not None else Progress()
        self.history: list[dict] = resume.history if resume is not None else []
        partial = resume.state.get("partial_epoch", {}) if resume is not None else {}
        carried = self.rank == 0 and self.progress.batch_in_epoch > 0
        self.loss_sum = torch.tensor(float(partial.get("loss_sum", 0.0)) if carried else 0.0, dtype=torch.float64)
        self.loss_count = int(partial.get("count", 0)) if carried else 0
        if resume is not None:
            self.optimizer.load_state_dict(resume.state["optimizer"])
            if self.scheduler is not None and resume.state.get("scheduler") is not None:
                self.scheduler.load_state_dict(resume.state["scheduler"])
            self.hooks.load_state_dict(resume.hook_states)
        self.context.update({
            "model": model, "ddp_model": self.ddp_model, "optimizer": self.optimizer,
            "scheduler": self.scheduler, "loss_fn": self.loss_fn, "epoch": self.progress.epoch, "batch_idx": 0,
            "global_step": self.progress.global_step, "state": self.progress,
        })

    def _shape_labels(self, model: nn.Module) -> list[int]:
        """Runs the model on two rows (eval mode, no RNG drawn) to learn its output shape,
        and shapes the labels to match."""
        shard = self.shard
        if len(shard.features) == 0:
            return []
        was_training = model.training
        model.eval()
        with torch.no_grad():
            output_shape = list(model(shard.features[:2].to(self.device)).shape[1:])
        model.train(was_training)
        shard.labels = shape_labels(shard.labels, output_shape, self.spec.label_name)
        shard.val_labels = shape_labels(shard.val_labels, output_shape, self.spec.label_name)
        return output_shape

    def _agree_on_rows(self) -> None:
        """Shares every rank's row counts, evens them out (see :mod:`balance`), and fixes
        the steps per epoch that all ranks take."""
        self.stage = "collective"
        shard = self.shard
        labels = shard.labels
        info = torch.zeros(5, self.world_size, dtype=torch.int64)
        info[:, self.rank] = torch.tensor([
            len(shard.features), len(shard.val_features),
            shard.features.shape[1] if len(shard.features) else 0,
            labels.shape[1] if labels.dim() > 1 else 0,
            int(len(labels) > 0 and not labels.is_floating_point()),
        ])
        info = self._all_reduce(info, dist.ReduceOp.SUM)
        self.train_rows = [int(n) for n in info[0]]
        self.val_rows = int(info[1].sum())
        plan = transfer_plan(self.train_rows)
        if plan:
            shard.features, shard.labels = rebalance(
                shard.features, shard.labels, plan, self.rank, feature_shape=(int(info[2].max()),),
                label_shape=(int(info[3].max()),) if int(info[3].max()) else (),
                label_dtype=torch.int64 if int(info[4].max()) else torch.float32, device=self.device,
            )
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
        size = self.spec.batch_size
        self.steps_per_epoch = max(math.ceil(n / size) for n in self.train_rows)
        self.step_samples = [
            sum(len(batch_positions(torch.empty(n), step, size)) for n in self.train_rows)
            for step in range(self.steps_per_epoch)
        ]

    def _restore_rng(self, resume: Checkpoint | None) -> None:
        states = resume.state["rng"] if resume is not None else []
        if states:
            state = states[self.rank % len(states)]
            torch.set_rng_state(state["torch"])
            random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
            np.random.set_state((state["numpy"][0], np.asarray(state["numpy"][1], dtype=np.uint32),
                                 *state["numpy"][2:]))
            if torch.cuda.is_available() and "cuda" in state:
                torch.cuda.set_rng_state(state["cuda"], self.device)
            return
        stream = np.random.SeedSequence([self.spec.seed, 1 << 20, self.rank]).generate_state(1)[0]
        torch.manual_seed(int(stream))
        random.seed(int(stream))
        np.random.seed(int(stream))

    # ------------------------------------------------------------------- training

    def _finished(self) -> bool:
        target, progress = self.spec.target, self.progress
        if self.control.stop_training or progress.epoch >= min(target.epoch, target.max_epochs):
            return True
        return target.global_step is not None and progress.global_step >= target.global_step

    def _train(self) -> None:
        self.model.train()
        while not self._finished():
            self.control.stop_epoch = False
            if self.progress.batch_in_epoch == 0:
                self._call("before_train_epoch")
                if self.hooks.has("before_train_epoch"):  # else the flags are as last combined
                    self._agree_on_flags()
                if self.control.stop_training:  # asked before the epoch's first step: none of it runs
                    break
            if self._train_epoch():
                self._end_epoch()

    def _train_epoch(self) -> bool:
        """Runs batches until the epoch ends (True) or the fit must stop mid-epoch (False)."""
        spec, shard = self.spec, self.shard
        epoch = self.progress.epoch
        order = epoch_order(len(shard.features), spec.seed, epoch, self.rank)
        for step in range(self.progress.batch_in_epoch, self.steps_per_epoch):
            if spec.target.global_step is not None and self.progress.global_step >= spec.target.global_step:
                return False
            rows = batch_positions(order, step, spec.batch_size)
            self._train_step(step, shard.features[rows], shard.labels[rows])
            self._maybe_write_checkpoint("ba")
            if self._sync_step_flags:
                self._agree_on_flags()
            if self.control.stop_training:
                return self.progress.batch_in_epoch >= self.steps_per_epoch
            if self.control.stop_epoch:
                return True
        return True

    def _train_step(self, step: int, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        context = self.context
        inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        context.update(batch_idx=step, batch=(inputs, labels), inputs=inputs, labels=labels)
        replaced = self._call("before_train_iter")
        if replaced is not None:
            inputs, labels = replaced
            context.update(batch=(inputs, labels), inputs=inputs, labels=labels)
        if self.hooks.train_step is not None:
            self.stage = "train_step"
            result = self.hooks.run_train_step(dict(context, model=self.ddp_model))
            loss, outputs = result if isinstance(result, tuple) else (result, None)
            context.update(outputs=outputs, loss=loss)
        else:
            loss = self._default_step(inputs, labels)
        self.loss_sum += loss.detach().double().cpu() * len(inputs)
        self.loss_count += len(inputs)
        self.progress = Progress(
            epoch=self.progress.epoch, batch_in_epoch=step + 1,
            global_step=self.progress.global_step + 1,
            samples=self.progress.samples + self.step_samples[step],
        )
        context.update(global_step=self.progress.global_step, state=self.progress)
        self._call("after_train_iter")
        self.reporter.step(self.progress, loss.detach(), self.steps_per_epoch)

    def _default_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        context = self.context
        self.stage = "forward"
        self.optimizer.zero_grad(set_to_none=True)
        outputs = self.ddp_model(inputs)
        self.stage = "loss"
        loss = self.loss_fn(outputs, labels)
        context.update(outputs=outputs, loss=loss)
        replaced = self._call("before_backward")
        if replaced is not None:
            # A constant loss still runs backward through the model, so DDP's gradient
            # all-reduce happens on every rank and the step simply has zero gradients.
            loss = replaced if replaced.requires_grad else replaced + 0.0 * outputs.sum()
            context["loss"] = loss
        self.stage = "backward"
        loss.backward()
        self._call("after_backward")
        self._call("before_optimizer_step")
        self.stage = "optimizer_step"
        self.optimizer.step()
        context["global_step"] = self.progress.global_step + 1  # the step is done from here on
        self._call("after_optimizer_step")
        return loss

    def _end_epoch(self) -> None:
        self.stage = "collective"
        totals = self._all_reduce(torch.tensor([float(self.loss_sum), float(self.loss_count)], dtype=torch.float64),
                                  dist.ReduceOp.SUM)
        entry: dict[str, Any] = {"epoch": self.progress.epoch + 1, "train_loss": float(totals[0] / totals[1])}
        self.loss_sum.zero_()
        self.loss_count = 0
        if self.val_rows:
            entry.update(self._validate())
        self.progress = Progress(epoch=self.progress.epoch + 1, batch_in_epoch=0,
                                 global_step=self.progress.global_step, samples=self.progress.samples)
        self.history.append(entry)
        self.context.update(epoch=self.progress.epoch, state=self.progress)
        self._call("after_train_epoch", metrics=entry)  # hooks may add values to the history entry
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
        """Loss and metrics over every rank's validation rows, weighted by rows."""
        self._call("before_val_epoch")
        self.stage = "validation"
        model, shard, size = self.model, self.shard, self.spec.batch_size
        names = sorted(self.metrics)
        sums = torch.zeros(1 + len(names), dtype=torch.float64)
        for metric in self.metrics.values():
            if hasattr(metric, "reset"):
                metric.reset()
        model.eval()
        with torch.no_grad():
            for start in range(0, len(shard.val_features), size):
                inputs = shard.val_features[start:start + size].to(self.device)
                labels = shard.val_labels[start:start + size].to(self.device)
                self.context.update(batch_idx=start // size, batch=(inputs, labels), inputs=inputs, labels=labels)
                self._call("before_val_iter")
                outputs = model(inputs)
                loss = self.loss_fn(outputs, labels)
                self.context.update(outputs=outputs, loss=loss)
                self._call("after_val_iter")
                sums[0] += float(loss) * len(inputs)
                for i, name in enumerate(names, start=1):
                    sums[i] += self._batch_metric(self.metrics[name], outputs, labels) * len(inputs)
        model.train()
        self.stage = "collective"
        sums = self._all_reduce(sums, dist.ReduceOp.SUM)
        values = {"val_loss": float(sums[0]) / self.val_rows}
        for i, name in enumerate(names, start=1):
            metric = self.metrics[name]
            values[f"val_{name}"] = float(metric.compute()) if _is_stateful(metric) else float(sums[i]) / self.val_rows
        self._call("after_val_epoch", metrics=values)  # hooks may add values to the history entry
        return values

    @staticmethod
    def _batch_metric(metric: Any, outputs: torch.Tensor, labels: torch.Tensor) -> float:
        if _is_stateful(metric):
            metric.update(outputs, labels)
            return 0.0
        return float(metric(outputs, labels))

    # -------------------------------------------------------------- hooks, flags

    def _call(self, stage: str, **extra: Any) -> Any:
        if not self.hooks.has(stage):
            return None
        self.stage = stage
        context = self.context
        if extra:
            context = dict(context, **extra)
        return self.hooks.call(stage, context)

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
            self.hooks.call("on_exception", dict(self.context, exception=error, stage=failed_stage))
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

    def _gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    # ---------------------------------------------------------------- checkpoints

    def _maybe_write_checkpoint(self, unit: str) -> None:
        every = self.spec.checkpoint_every
        if self.spec.checkpoint_dir is None or every is None or every[1] != unit:
            return
        count = self.progress.epoch if unit == "ep" else self.progress.global_step
        if count % every[0]:
            return
        blob = self._checkpoint_bytes()
        if blob is not None:
            started = time.perf_counter()
            path = CheckpointDir(self.spec.checkpoint_dir, run_id=self.spec.run_id).write(
                blob, self.progress.epoch, self.progress.global_step)
            logger.info("rank 0: wrote %s (%.1f MB) in %.2fs", path, len(blob) / 1e6, time.perf_counter() - started)

    def _checkpoint_bytes(self) -> bytes | None:
        """Collective: gathers every rank's RNG state; rank 0 returns the serialized checkpoint."""
        self.stage = "checkpoint"
        rng = self._gather(self._rng_state())
        partial = self._all_reduce(torch.tensor([float(self.loss_sum), float(self.loss_count)], dtype=torch.float64),
                                   dist.ReduceOp.SUM)
        if self.rank != 0:
            return None
        state = {
            "format_version": FORMAT_VERSION,
            "meta": {
                "run_id": self.spec.run_id,
                "param_shapes": {k: list(v.shape) for k, v in self.model.state_dict().items()},
                "output_shape": self.output_shape,
                "label_kind": "int" if not self.shard.labels.is_floating_point() else "float",
                "num_features": int(self.shard.features.shape[1]),
                "max_epochs": self.spec.target.max_epochs,
                "world_size": self.world_size,
            },
            "progress": self.progress.to_dict(),
            "history": self.history,
            "partial_epoch": {"loss_sum": float(partial[0]), "count": int(partial[1])},
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": rng,
            "hooks": self.hooks.state_dict(),
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def _rng_state(self) -> dict[str, Any]:
        python = random.getstate()
        numpy_state = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "python": [python[0], list(python[1]), python[2]],
            "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]],
        }
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state


def _is_stateful(metric: Any) -> bool:
    return hasattr(metric, "update") and hasattr(metric, "compute")


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
