"""How the driver runs one contender in a fresh ``python -m benchmarks.<module>`` process.

Cold measurements need a fresh SparkSession, hence a fresh process; every contender runs
the same way so none starts warmer than another. The child gets the workload as JSON and
a scratch directory, and prints its result as one line ``BENCH_RESULT {json}`` on stdout
(other output, such as torchrun's, may surround it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable

from benchmarks.recommender import RecWorkload
from benchmarks.workload import IngestWorkload, WorkloadBase, Workload

__all__ = ["ContenderError", "contender_main", "run_contender", "load_workload", "use_local_environment"]

_KINDS = {kind.kind: kind for kind in (Workload, IngestWorkload, RecWorkload)}

_MARKER = "BENCH_RESULT "


class ContenderError(RuntimeError):
    """A contender process failed or printed no result; carries the end of its output."""


def use_local_environment() -> None:
    """Executors run this interpreter and everything binds to loopback (as `make bench`)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def load_workload(text: str) -> WorkloadBase:
    """The workload of any kind that ``to_json`` wrote."""
    return _KINDS[json.loads(text)["kind"]].from_json(text)


def contender_main(measure: Callable[[WorkloadBase, str, str], dict]) -> None:
    """The ``__main__`` of a contender module: parses the arguments, measures, prints.

    Args:
        measure: ``measure(workload, scratch_dir, variant) -> result dict``.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True, help="Workload.to_json()")
    parser.add_argument("--variant", default="", help="which flavour of the contender")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        result = measure(load_workload(args.workload), scratch, args.variant)
    print(_MARKER + json.dumps(result), flush=True)


def run_contender(module: str, workload: WorkloadBase, variant: str = "", timeout_s: float = 400.0) -> dict:
    """Runs ``python -m benchmarks.<module>`` and returns its result dict.

    Raises:
        ContenderError: The process failed, timed out or printed no result line.
    """
    command = [sys.executable, "-m", f"benchmarks.{module}", "--workload", workload.to_json()]
    if variant:
        command += ["--variant", variant]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        raise ContenderError(f"{module} {variant}: no result within {timeout_s:.0f}s\n"
                             f"{_tail(error.stdout)}{_tail(error.stderr)}") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(_MARKER)]
    if done.returncode != 0 or not lines:
        raise ContenderError(f"{module} {variant}: exit code {done.returncode}, "
                             f"{'no' if not lines else 'a'} result line\n{_tail(done.stdout)}{_tail(done.stderr)}")
    return json.loads(lines[-1][len(_MARKER):])


def _tail(text: str | bytes | None, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:]) + "\n"
