"""[executor] The run's state on one rank, and the checkpoints built from it.

:class:`RunState` is the one object a checkpoint is built from: the counters the loop
advances (progress, history, the epoch's loss so far, where the epoch continues), the
objects whose states the checkpoint keeps (model, optimizer, scheduler, gradient scaler,
hooks) and what the fit's rows were. It continues the run of the checkpoint a fit resumes
(:meth:`RunState.restore`) and writes checkpoints: periodic ones to ``checkpointDir``
(:meth:`RunState.write_checkpoint`, when :meth:`RunState.checkpoint_due`) and the one the
driver keeps (:meth:`RunState.result`); what they hold of the model and optimizer is the
strategy's business (:mod:`spark_torch_est.train.strategies`). Writing a checkpoint is a
collective: every rank's RNG state and loss sums go into it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from spark_torch_est.checkpoints.checkpoint import Checkpoint
from spark_torch_est.checkpoints.storage import CheckpointDir
from spark_torch_est.core.progress import Progress
from spark_torch_est.core.ranks import Ranks
from spark_torch_est.core.spec import TaskSpec, placed_by
from spark_torch_est.errors import InputDataError
from spark_torch_est.ingest.agreement import AgreedRows
from spark_torch_est.train.hooks import HookSet
from spark_torch_est.train.losses import NonFiniteLossError
from spark_torch_est.train.precision import Precision
from spark_torch_est.train.strategies.base import Strategy

__all__ = ["RunState"]

logger = logging.getLogger(__name__)


class RunState:
    """What a checkpoint of the run holds, on one rank, as the loop advances it.

    Args:
        spec: The fit's description.
        ranks: This rank and its peers.
        rows: The fit's rows, as the ranks agreed on them.
        output_shape: The model's output shape per row.
        optimizer_made: Each param group's hyper-parameters as the optimizer creator made
            them (before a scheduler or a checkpoint changed them).
        scheduler: The optimizer's LR scheduler, or None.
        precision: The fit's precision (and gradient scaler).
        hooks: The fit's hooks.
        strategy: How the model is distributed, with the model already wrapped and the
            optimizer attached (the model and optimizer are taken from it): what a
            checkpoint holds of them.

    Attributes:
        model: The model (not its DDP or compiled wrapper), the strategy's.
        optimizer: Its optimizer, the strategy's.
        progress: Where the run stands.
        history: One metrics entry per completed epoch.
        loss_sum: This rank's weighted loss sum of the epoch so far (the steps read so far).
        loss_count: This rank's weight (rows) of the epoch so far.
        offset: Rows of its order each rank trained on in this epoch before this fit.
    """

    def __init__(self, spec: TaskSpec, ranks: Ranks, rows: AgreedRows, output_shape: list[int],
                 optimizer_made: list[dict], scheduler: Any, precision: Precision, hooks: HookSet,
                 strategy: Strategy) -> None:
        self.spec, self.ranks, self.rows, self.output_shape = spec, ranks, rows, output_shape
        self.model, self.optimizer, self.optimizer_made = strategy.model, strategy.optimizer, optimizer_made
        self.scheduler, self.precision, self.hooks, self.strategy = scheduler, precision, hooks, strategy
        self.progress = Progress()
        self.history: list[dict] = []
        self.loss_sum = self.loss_count = 0.0
        self.offset = 0

    # ------------------------------------------------------------------- the run

    def restore(self, resume: Checkpoint) -> None:
        """Continues the run of ``resume``: its counters, and the optimizer, scheduler, scaler
        and hook states (and under a sharded strategy, "fsdp", the model's shards; else the
        model holds the run's weights already). A hyper-parameter the optimizer creator now makes differently (a
        new config) takes its new value; the others keep the run's, as a scheduler left them.
        Hooks added since keep their own state.

        Raises:
            IncompatibleCheckpointError: The checkpoint does not hold what the strategy needs
                ("fsdp" resuming from a checkpoint that is not sharded).
        """
        self.progress, self.history = resume.progress, resume.history
        if self.ranks.rank == 0 and self.progress.batch_in_epoch > 0:  # rank 0 carries the epoch's sums
            self.loss_sum, self.loss_count = resume.partial_loss
        self.strategy.restore(resume)
        self.precision.load_state_dict(resume.scaler_state)
        if self.scheduler is not None and resume.scheduler_state is not None:
            self.scheduler.load_state_dict(resume.scheduler_state)
        for group, made, before in zip(self.optimizer.param_groups, self.optimizer_made, resume.optimizer_made):
            group.update({key: value for key, value in made.items() if not _same(before.get(key, value), value)})
        self.hooks.load_state_dict({name: state for name, state in resume.hook_states.items()
                                    if name not in self.spec.fresh_hooks})
        self.offset = self._resume_offset(resume)

    def _resume_offset(self, resume: Checkpoint) -> int:
        """Rows of its order each rank already trained on in the current epoch.

        The position is kept in samples, so a changed ``batchSize`` or ``numWorkers``, or
        the same rows read another way, continue the epoch exactly where it stopped (the
        order is the run's logical shards', see :mod:`spark_torch_est.ingest.canonical`).
        With other data the rows and orders differ: the epoch then continues from the same
        fraction of its rows.
        """
        done, train_rows, world_size = self.progress.sample_in_epoch, self.rows.train_rows, self.ranks.world_size
        if done == 0:
            return 0
        rows, source = sum(train_rows), self.spec.data_source
        if resume.epoch_rows == rows and placed_by(resume.data_source) == placed_by(source):
            return self.rows.offset(done)
        fraction = done / max(resume.epoch_rows, 1)
        if self.ranks.rank == 0:
            def read(data_source: str) -> str:
                return {"partitions": "read through Spark in its order", "files": "read from the table's files",
                        "round robin": "read through Spark, placed as before the rows were dealt out by position",
                        "hash": "placed by hashing"}[placed_by(data_source)]

            logger.warning(
                "the epoch in progress began with %d training rows on %d workers (%s) and continues with %d rows on "
                "%d (%s): it goes on from the same fraction (%.1f%%) of each worker's rows", resume.epoch_rows,
                resume.world_size, read(resume.data_source), rows, world_size, read(source), 100 * fraction)
        return min(int(fraction * max(train_rows)), max(train_rows) - 1)

    def step_done(self, samples: int) -> None:
        """Counts one more optimizer step, over ``samples`` rows of all ranks."""
        self.progress = self.progress.to_next_batch(samples)

    def add_loss(self, value: float, rows: float) -> None:
        """Counts one step's loss into the epoch's mean, weighted by its ``rows`` (or weights)."""
        self.loss_sum += value * rows
        self.loss_count += rows

    def loss_totals(self) -> tuple[float, float]:
        """Collective: the epoch's weighted loss sum and weight so far, all ranks together."""
        totals = self.ranks.all_reduce(torch.tensor([self.loss_sum, self.loss_count], dtype=torch.float64))
        total, count = totals.tolist()
        return total, count

    def epoch_entry(self) -> dict[str, Any]:
        """Collective: the history entry of the epoch ending now, with its mean training
        loss (NaN when every weight was 0, with ``allowNonFinite``); the epoch's sums start again.
        The first entry a branch closes names its parent (``"branch_of": "<run>@<global step>"``).

        Raises:
            InputDataError: The epoch's weights sum to 0 (unless ``allowNonFinite``).
        """
        total, count = self.loss_totals()
        weight_col = self.spec.columns.weight
        if not count and weight_col is not None and not self.spec.allow_non_finite:
            raise InputDataError(
                f"weightCol {weight_col!r}: the training rows' weights sum to 0 in epoch {self.progress.epoch + 1} "
                "(all ranks together), so its loss is 0/0 and no row moved the model's weights; give some training "
                "rows a positive weight, or set allowNonFinite=True to train on (train_loss is then NaN)")
        self.loss_sum = self.loss_count = 0.0
        entry: dict[str, Any] = {"epoch": self.progress.epoch + 1,
                                 "train_loss": total / count if count else float("nan"),
                                 "world_size": self.ranks.world_size}
        parent = self.spec.parent
        if parent is not None and all(e.get("branch_of") != str(parent) for e in self.history):
            entry["branch_of"] = str(parent)  # the branch's first epoch says where it began
        return entry

    def end_epoch(self, entry: dict[str, Any]) -> None:
        """Completes the epoch: the progress moves to the next one, ``entry`` joins the history."""
        self.progress = self.progress.to_next_epoch()
        self.offset = 0
        self.history.append(entry)

    # ---------------------------------------------------------------- checkpoints

    def checkpoint_due(self, unit: str) -> bool:
        """Whether ``checkpointInterval`` asks for a periodic checkpoint in ``checkpointDir``
        just after this ``unit`` ("ep" or "ba")."""
        every = self.spec.checkpoint_every
        return self.spec.checkpoint_dir is not None and every is not None and every.due(self.progress, unit)

    def write_checkpoint(self) -> None:
        """Collective: writes a checkpoint of the run as it is now to ``checkpointDir``: every
        rank's parts where the strategy shards the state, then rank 0 the ``.pt`` (written
        last: a checkpoint whose parts are not all written has none)."""
        started = time.perf_counter()
        directory = CheckpointDir(self.spec.checkpoint_dir or "", run_id=self.spec.run_id)
        progress = self.progress
        self.strategy.save_parts(directory.sharded_url(progress.epoch, progress.global_step), progress.global_step)
        blob = self.checkpoint_bytes()
        if blob is not None:
            path = directory.write(blob, progress.epoch, progress.global_step)
            logger.info("rank 0: wrote %s (%.1f MB) in %.2fs", path, len(blob) / 1e6, time.perf_counter() - started)

    def result(self) -> bytes | None:
        """Collective: the checkpoint the driver keeps, on rank 0. Where the strategy shards
        the state it points at a sharded checkpoint of the state as it is now (written unless
        the last one is) and holds the full weights, gathered once here, for the fitted model."""
        if self.strategy.parts_behind(self.progress.global_step):
            self.write_checkpoint()
        return self.checkpoint_bytes(final=True)

    def checkpoint_bytes(self, final: bool = False) -> bytes | None:
        """Collective: gathers every rank's RNG state; rank 0 returns the serialized checkpoint,
        with what the strategy saves of the model and optimizer (``final``: the fit's last
        checkpoint, which holds the full weights).

        Raises:
            NonFiniteLossError: The weights hold NaN or infinite values (unless ``allowNonFinite``).
        """
        states = self.strategy.saved_states(final)
        rng_states, partial = self.ranks.rng_states(), self.loss_totals()
        if states is None:
            return None
        self._check_finite(states.model)
        spec, train = self.spec, self.rows.train
        return Checkpoint.build(
            run_id=spec.run_id, fit_id=spec.fit_id, progress=self.progress, history=self.history,
            partial_loss=partial, epoch_rows=sum(self.rows.train_rows), world_size=self.ranks.world_size,
            shards=self.rows.shards,
            data_source=spec.data_source, seed=spec.seed, optimizer_made=self.optimizer_made,
            output_shape=self.output_shape, label_kind="float" if train.labels.dtype.is_floating_point else "int",
            input_schema=spec.schema.to_dict(),
            input_rows=[list(c.shape) if c.shape is not None else list(rows.row_shape) if rows.row_shape is not None
                        else None for c, rows in zip(spec.schema.columns, train.inputs)],
            model=states.model, optimizer=states.optimizer,
            scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
            rng=rng_states, hooks=self.hooks.state_dict(), precision=self.precision.name,
            scaler=self.precision.state_dict(), strategy=spec.strategy,
            sharded=states.sharded, parent=spec.parent,
        ).to_bytes()

    def _check_finite(self, model_state: dict[str, torch.Tensor]) -> None:
        """Raises NonFiniteLossError if the weights became NaN or infinite (a finite loss can
        still give NaN gradients), unless ``allowNonFinite``."""
        broken = [k for k, v in model_state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if broken and not self.spec.allow_non_finite:
            raise NonFiniteLossError(
                f"the model's weights became NaN or infinite ({', '.join(broken[:5])}) by epoch "
                f"{self.progress.epoch + 1}, global step {self.progress.global_step}, although every loss was "
                "finite: a gradient was not (clip gradients, lower the learning rate, check sqrt/log/norm at 0); "
                "set allowNonFinite=True to keep such weights"
            )


def _same(a: Any, b: Any) -> bool:
    """Whether two hyper-parameter values are equal (numbers, tuples or tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b
