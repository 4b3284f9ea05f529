"""The typed-inputs table: ``inputCols`` against ``featuresCol`` on the reference workload,
and the recommender's training loop against bare DDP on the same tensors."""

from __future__ import annotations

from benchmarks.tables import COMPARISON_HEADER, Pick, Summary, Table, get, mean, rate, seconds, us

__all__ = ["typed_table"]

_FEATURES = "featuresCol, same process (A B B A)"


def typed_table(summary: Summary, labels: dict[str, str]) -> Table | None:
    """The table, or None when neither the reference estimator nor the recommender ran."""
    rows = []
    if "te" in labels:
        for figure, field, unit, target in (
            ("reference workload: warm fit wall time", "wall_s", seconds, "<=1.05x"),
            ("reference workload: training loop samples/s", "samples_per_s", rate, ">=0.95x"),
            ("reference workload: training loop CPU per sample, rank 0", "cpu_us_per_sample", us, ""),
            ("reference workload: call to first optimizer step, warm", "first_step_s", seconds, ""),
        ):
            rows.append(summary.compare(f"{figure}, inputCols=['features']", _inputs(field), _FEATURES,
                                        _features(field), unit, target))
    if "rec_te" in labels and "rec_ddp" in labels:
        rows.append(summary.compare("recommender: training loop samples/s (warm fit)",
                                    get("rec_te", "warm", "samples_per_s"), labels["rec_ddp"],
                                    get("rec_ddp", "samples_per_s"), rate, ">=0.95x"))
        rows.append(summary.compare("recommender: training loop CPU per sample, rank 0",
                                    get("rec_te", "warm", "cpu_us_per_sample"), labels["rec_ddp"],
                                    get("rec_ddp", "cpu_us_per_sample"), us))
    return Table("Typed inputs (inputCols)", COMPARISON_HEADER, rows) if rows else None


def _inputs(field: str) -> Pick:
    """The two warm fits with ``inputCols``."""
    return mean(get("te", "typed", "inputs", 0, field), get("te", "typed", "inputs", 1, field))


def _features(field: str) -> Pick:
    """The two warm fits with ``featuresCol`` around them: the suite's warm fit and the last one."""
    return mean(get("te", "warm", field), get("te", "typed", "features", 0, field))
