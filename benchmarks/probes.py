"""What every contender measures inside its training processes, the same way everywhere.

A :class:`StepClock` stamps the wall time at the end of the first and the last optimizer
step; :func:`write_rank_report` leaves it, with the process's peak RSS, in a JSON file per
rank that the driver reads after the call returns. Wall-clock ``time.time()`` is used
because the stamps are compared across processes. Pickled by value (see
:mod:`benchmarks.remote`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

__all__ = ["StepClock", "RankReport", "peak_rss_mb", "reset_peak_rss", "write_rank_report", "read_rank_reports"]


@dataclass
class StepClock:
    """Stamps of a rank's optimizer steps in one call: wall time, process CPU time (all
    threads) and how many samples all ranks had trained.

    Attributes:
        first: ``time.time()`` after the first step, or None before it.
        last: ``time.time()`` after the latest step.
        cpu_first: ``time.process_time()`` after the first step.
        cpu_last: ``time.process_time()`` after the latest step.
        samples_first: Samples of all ranks trained when the first step ended.
        samples_last: Samples of all ranks trained when the latest step ended.
        steps: Steps taken.
    """

    first: float | None = None
    last: float | None = None
    cpu_first: float | None = None
    cpu_last: float | None = None
    samples_first: int = 0
    samples_last: int = 0
    steps: int = 0

    def step(self, samples: int) -> None:
        """Records the end of one optimizer step.

        Args:
            samples: Samples all ranks have trained so far (counted from any origin).
        """
        now, cpu = time.time(), time.process_time()
        if self.first is None:
            self.first, self.cpu_first, self.samples_first = now, cpu, samples
        self.last, self.cpu_last, self.samples_last = now, cpu, samples
        self.steps += 1


@dataclass
class RankReport:
    """One rank's measurements in one call.

    Attributes:
        rank: The rank.
        first_step: Wall time after the first step.
        last_step: Wall time after the last step.
        loop_cpu_s: CPU seconds the process used from the first to the last step.
        loop_samples: Samples all ranks trained from the first to the last step.
        steps: Steps taken.
        finished: Wall time when the rank finished training (before returning results).
        peak_rss_mb: The process's peak resident set size (``VmHWM``), MB.
    """

    rank: int
    first_step: float
    last_step: float
    loop_cpu_s: float
    loop_samples: int
    steps: int
    finished: float
    peak_rss_mb: float

    @classmethod
    def from_clock(cls, rank: int, clock: StepClock) -> RankReport:
        """This process's report now."""
        return cls(rank=rank, first_step=clock.first, last_step=clock.last,
                   loop_cpu_s=clock.cpu_last - clock.cpu_first, loop_samples=clock.samples_last - clock.samples_first,
                   steps=clock.steps, finished=time.time(), peak_rss_mb=peak_rss_mb())

    def loop_figures(self) -> dict[str, float | None]:
        """The training loop between the end of the first and of the last step:
        ``samples_per_s`` (all ranks), ``cpu_us_per_sample`` (this process's CPU time per
        sample of all ranks, which contention barely moves), ``loop_s`` and ``steps``."""
        seconds = self.last_step - self.first_step
        timed = self.steps > 1 and self.loop_samples > 0
        return {
            "samples_per_s": self.loop_samples / seconds if timed else None,
            "cpu_us_per_sample": self.loop_cpu_s * 1e6 / self.loop_samples if timed else None,
            "loop_s": seconds,
            "loop_samples": self.loop_samples,
            "steps": self.steps,
        }


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB, from ``/proc/self/status``."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> bool:
    """Sets this process's peak RSS (``VmHWM``) back to its current RSS, so that a later
    :func:`peak_rss_mb` tells the peak since now (Linux >= 4.0: ``/proc/self/clear_refs``).
    Returns False where the system refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def write_rank_report(directory: str, tag: str, report: RankReport) -> None:
    """Writes ``<directory>/<tag>-rank<rank>.json``."""
    with open(os.path.join(directory, f"{tag}-rank{report.rank}.json"), "w") as handle:
        json.dump(asdict(report), handle)


def read_rank_reports(directory: str, tag: str, ranks: int) -> list[RankReport]:
    """The reports of ranks ``0 .. ranks-1`` for ``tag``, in rank order."""
    reports = []
    for rank in range(ranks):
        with open(os.path.join(directory, f"{tag}-rank{rank}.json")) as handle:
            reports.append(RankReport(**json.load(handle)))
    return reports
