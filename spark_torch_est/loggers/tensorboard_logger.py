"""[driver] TensorBoardLogger: TensorBoard event files, one folder per estimator run."""

from __future__ import annotations

import importlib.util
from typing import Any

from spark_torch_est.errors import InvalidInputError
from spark_torch_est.loggers.base import Logger, run_folder, scalars, tracked_params

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(Logger):
    """Writes each estimator run to ``<log_dir>/<first 12 characters of its run id>``: the
    numbers of each history entry as scalars at ``step=epoch``, rank 0's throttled loss as
    ``train_loss_step`` at ``step=global_step``, and the Params and config as text. Later
    fits of the run add event files to the same folder, so TensorBoard shows one run.

    Args:
        log_dir: A local folder (default ``"runs"``, as torch's ``SummaryWriter``).

    Raises:
        InvalidInputError: tensorboard is not installed.
    """

    def __init__(self, log_dir: str = "runs") -> None:
        if importlib.util.find_spec("tensorboard") is None:
            raise InvalidInputError("TensorBoardLogger needs tensorboard: pip install 'spark-torch-est[tensorboard]'")
        self.log_dir = log_dir
        self._writers: dict[str, Any] = {}  # estimator run id -> this fit's SummaryWriter

    def run_dir(self, run_id: str) -> str:
        """The folder of the estimator run ``run_id``."""
        return run_folder(self.log_dir, run_id)

    def on_fit_start(self, params: dict, config: dict, progress: Any, run_id: str) -> None:
        """Opens the run's folder and records the Params and config."""
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(self.run_dir(run_id))
        rows = "\n".join(f"| {key} | {value} |" for key, value in tracked_params(params, config).items())
        writer.add_text("params", "| param | value |\n|---|---|\n" + rows, global_step=progress.epoch)
        self._writers[run_id] = writer

    def on_step(self, progress: Any, loss: float, run_id: str) -> None:
        """Adds the step loss."""
        self._writers[run_id].add_scalar("train_loss_step", loss, global_step=progress.global_step)

    def on_epoch_end(self, metrics: dict, run_id: str) -> None:
        """Adds a history entry's numbers."""
        writer = self._writers[run_id]
        for key, value in scalars(metrics).items():
            writer.add_scalar(key, value, global_step=int(metrics["epoch"]))
        writer.flush()

    def _close(self, run_id: str) -> None:
        """Closes the fit's event file (the fit ended or failed; what was written stays)."""
        self._writers.pop(run_id).close()

    on_fit_end = on_fit_failed = _close
