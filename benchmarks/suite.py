"""The workloads, the contenders and the interleaved rounds that run them.

Every round runs every contender once, in the same order (A B C D, A B C D, ...), so
slow drift of the machine hits all of them alike; each run is a fresh process. Each
contender works on one of three workloads: the reference MLP, the recommender
(:mod:`benchmarks.recommender`) and the ingest table
(:class:`~benchmarks.workload.IngestWorkload`); contenders compared with each other share
one and stand next to each other in the round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from benchmarks.dataset import write_parquet, write_table_file
from benchmarks.machine import ForeignLoad
from benchmarks.protocol import ContenderError, run_contender
from benchmarks.recommender import RecWorkload, write_rec_parquet
from benchmarks.workload import IngestWorkload, WorkloadBase, Workload

__all__ = ["Contender", "CONTENDERS", "WORKLOADS", "run_rounds", "failures"]

#: Each workload's class (``quick()`` gives its smoke-test size) and the function that
#: writes its Parquet into a directory and returns the path.
WORKLOADS: dict[str, tuple[type, Callable[[WorkloadBase, str], str]]] = {
    "reference": (Workload, write_parquet),
    "recommender": (RecWorkload, write_rec_parquet),
    "ingest": (IngestWorkload, write_table_file),
}


@dataclass(frozen=True)
class Contender:
    """One way to do the work.

    Attributes:
        key: Short name, the key of its results in a round.
        module: ``benchmarks.<module>`` runs it.
        variant: Passed to the module as ``--variant``.
        label: How tables name it.
        workload: The key of its workload in :data:`WORKLOADS` (default ``"reference"``).
    """

    key: str
    module: str
    variant: str
    label: str
    workload: str = "reference"


CONTENDERS: tuple[Contender, ...] = (
    Contender("plain", "plain", "", "plain torch, 1 process"),
    Contender("ddp", "ddp", "", "bare DDP (spawn, gloo)"),
    Contender("td_local", "distributor", "local", "TorchDistributor local_mode=True"),
    Contender("td_barrier", "distributor", "barrier", "TorchDistributor local_mode=False"),
    Contender("te", "estimator", "", "TorchEstimator (this project)"),
    Contender("rec_ddp", "ddp", "", "bare DDP (spawn, gloo), recommender", "recommender"),
    Contender("rec_te", "rec_estimator", "", "TorchEstimator, recommender", "recommender"),
    Contender("ingest_pyarrow", "ingest_pyarrow", "", "pyarrow into numpy, ingest table", "ingest"),
    Contender("ingest_pyarrow_default", "ingest_pyarrow", "default", "pyarrow defaults into numpy, ingest", "ingest"),
    Contender("ingest_te", "ingest_estimator", "", "TorchEstimator, ingest table", "ingest"),
)


def run_rounds(workloads: dict[str, WorkloadBase], contenders: list[Contender], repeat: int, load: ForeignLoad,
               log: Callable[[str], None]) -> list[dict[str, dict]]:
    """Runs ``repeat`` rounds; returns one ``{contender key: result}`` per round.

    Each result also holds ``_elapsed_s`` (the process, start to exit) and
    ``_foreign_cores`` (CPU other processes used meanwhile, in cores); a contender that
    failed has only those and ``_error``.
    """
    rounds = []
    for number in range(1, repeat + 1):
        results = {}
        for contender in contenders:
            foreign_before, started = load.cpu_s, time.perf_counter()
            try:
                result = run_contender(contender.module, workloads[contender.workload], contender.variant)
            except ContenderError as error:  # the other contenders still run; the report says n/a
                result = {"_error": str(error)}
                log(f"round {number}/{repeat}: {contender.label} FAILED:\n{error}")
            elapsed = time.perf_counter() - started
            result["_elapsed_s"] = elapsed
            result["_foreign_cores"] = (load.cpu_s - foreign_before) / elapsed
            results[contender.key] = result
            log(f"round {number}/{repeat}: {contender.label:<40} {elapsed:6.1f} s"
                f"   (other processes: {result['_foreign_cores']:.2f} cores)")
        rounds.append(results)
    return rounds


def failures(rounds: list[dict[str, dict]]) -> list[str]:
    """``"<contender> (round n)"`` for every run that failed."""
    return [f"{key} (round {number})" for number, results in enumerate(rounds, start=1)
            for key, result in results.items() if "_error" in result]
