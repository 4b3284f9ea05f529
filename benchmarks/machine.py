"""The machine the numbers come from, and how much of it other processes used meanwhile.

:class:`ForeignLoad` samples ``/proc`` once a second and adds up the CPU time of every
process that is not this process or one of its descendants. Divided by the wall time it
says how many cores other work took from the benchmark; above a quarter of a core the
report calls the timings disturbed.
"""

from __future__ import annotations

import os
import platform
import sys
import threading

__all__ = ["describe", "describe_markdown", "ForeignLoad", "load_note"]

_TICKS = os.sysconf("SC_CLK_TCK")
_DISTURBED_CORES = 0.25


def describe() -> dict[str, str]:
    """Cores, memory, OS and the versions that matter, as display strings."""
    import pyarrow
    import pyspark
    import torch

    with open("/proc/meminfo") as meminfo:
        total_kb = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    return {
        "cpus": f"{len(os.sched_getaffinity(0))} usable of {os.cpu_count()} ({_cpu_model()})",
        "memory": f"{total_kb / 1024 ** 2:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "pyspark": pyspark.__version__,
        "pyarrow": pyarrow.__version__,
        "load average at start": " ".join(f"{v:.2f}" for v in os.getloadavg()),
    }


def describe_markdown() -> str:
    """:func:`describe` as a Markdown list."""
    return "\n".join(f"- {name}: {value}" for name, value in describe().items())


def load_note(foreign_cpu_s: float, wall_s: float, worst: float, where: str) -> str:
    """The run's last line: how much CPU other processes took (on average and at most, during
    which contender), the total time, and a warning when that disturbed the timings."""
    average = foreign_cpu_s / wall_s
    note = (f"Other processes used {average:.2f} cores on average during the run "
            f"(most: {worst:.2f} cores, during {where}). Total time {wall_s / 60:.1f} min.")
    if average > _DISTURBED_CORES or worst > 2 * _DISTURBED_CORES:
        note += " **Timings are disturbed by other load on this machine: rerun on an idle one.**"
    return note


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def _processes() -> dict[int, tuple[int, float, float]]:
    """``{pid: (parent pid, CPU seconds, start time in seconds since boot)}``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the command: state ppid ... utime(12) stime(13) ... starttime(20), 0-based here
        found[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS, int(fields[19]) / _TICKS)
    return found


def _uptime() -> float:
    with open("/proc/uptime") as uptime:
        return float(uptime.read().split()[0])


def _descendants(root: int, processes: dict[int, tuple[int, float, float]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    found, stack = {root}, [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


class ForeignLoad:
    """Background sampler of the CPU time other processes use; a context manager.

    Attributes:
        cpu_s: CPU seconds used by foreign processes since the sampler started.
    """

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.cpu_s = 0.0
        self._seen: dict[int, float] = {}
        self._ours: set[int] = set()  # ever ours: orphans of a finished contender stay ours
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="foreign-load", daemon=True)
        self._since = _uptime()

    def __enter__(self) -> ForeignLoad:
        self._sample(first=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self, first: bool = False) -> None:
        processes = _processes()
        self._ours |= _descendants(os.getpid(), processes)
        for pid, (_, cpu, started) in processes.items():
            if pid in self._ours:
                continue
            if pid in self._seen:
                before = self._seen[pid]
            else:  # a process born after the sampler started used all its CPU time meanwhile
                before = cpu if first or started < self._since else 0.0
            self.cpu_s += max(0.0, cpu - before)
            self._seen[pid] = cpu
