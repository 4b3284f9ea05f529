"""[driver] CSVLogger: plain CSV files, one folder per estimator run."""

from __future__ import annotations

import csv
import json
import os
from typing import Any

from spark_torch_est.loggers.base import Logger, run_folder, tracked_params

__all__ = ["CSVLogger"]


class CSVLogger(Logger):
    """Writes each estimator run to ``<log_dir>/<first 12 characters of its run id>/``:
    ``metrics.csv`` (one row per history entry, one column per name), ``steps.csv`` (rank
    0's throttled loss: ``global_step,epoch,train_loss_step``) and ``params.json`` (the
    latest fit's Params and config). Later fits of the run add to the same files.

    Args:
        log_dir: A local folder (default ``"csv_logs"``).
    """

    def __init__(self, log_dir: str = "csv_logs") -> None:
        self.log_dir = log_dir

    def run_dir(self, run_id: str) -> str:
        """The folder of the estimator run ``run_id``."""
        return run_folder(self.log_dir, run_id)

    def on_fit_start(self, params: dict, config: dict, run_id: str) -> None:
        """Creates the run's folder and writes ``params.json``."""
        os.makedirs(self.run_dir(run_id), exist_ok=True)
        with open(os.path.join(self.run_dir(run_id), "params.json"), "w") as f:
            json.dump(tracked_params(params, config), f, indent=1, default=str)

    def on_step(self, progress: Any, loss: float, run_id: str) -> None:
        """Appends a row to ``steps.csv``."""
        path = os.path.join(self.run_dir(run_id), "steps.csv")
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["global_step", "epoch", "train_loss_step"])
            writer.writerow([progress.global_step, progress.epoch, loss])

    def on_epoch_end(self, metrics: dict, run_id: str) -> None:
        """Adds a row to ``metrics.csv``, rewriting it when the entry brings a new column."""
        path = os.path.join(self.run_dir(run_id), "metrics.csv")
        rows: list[dict] = []
        if os.path.exists(path):
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        rows.append(metrics)
        columns = list(dict.fromkeys(key for row in rows for key in row))
        with open(path + ".tmp", "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(path + ".tmp", path)
