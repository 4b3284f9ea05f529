"""The probe hook that measures ``TorchEstimator`` fits from inside the ranks.

Pickled by value (see :mod:`benchmarks.remote`).
"""

from __future__ import annotations

from spark_torch_est import Hook, Progress

from benchmarks.probes import RankReport, StepClock, reset_peak_rss, write_rank_report

__all__ = ["ProbeHook"]


class ProbeHook(Hook):
    """Stamps every rank's first and last optimizer step of a fit and, at ``after_run``,
    writes them with the rank's peak RSS to ``<directory>/<tag>-rank<r>.json``, then
    resets the peak: Spark reuses a session's Python workers, so the next fit on the same
    worker reports the peak since this fit ended (the first fit of a session, in fresh
    workers, reports the workers' whole life).

    The first stamp is the first ``after_train_iter`` of the fit: ``global_step == 1``
    for a fresh run, the step after the resume point for a resumed one. Samples are
    counted with ``state.samples`` (all ranks, as trained, including rows a smaller
    partition repeats to keep the ranks in step).

    Args:
        directory: Where the rank reports go (a local path: ``local[n]`` shares the disk).
        tag: Names this fit's reports.
    """

    def __init__(self, directory: str, tag: str) -> None:
        self.directory = directory
        self.tag = tag
        self._clock = StepClock()

    def after_train_iter(self, state: Progress) -> None:
        self._clock.step(state.samples)

    def after_run(self, rank: int) -> None:
        write_rank_report(self.directory, self.tag, RankReport.from_clock(rank, self._clock))
        reset_peak_rss()
