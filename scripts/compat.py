"""The support matrix, tested: one virtualenv per Databricks ML runtime row, built from the
package registry, and in each the unit tests and the compat subset of the Spark tests.

    python3.11 scripts/compat.py                 # every row (make test-compat)
    python3.11 scripts/compat.py 15.4 newest     # some rows
    python3.11 scripts/compat.py newest --marks compat   # CI's newest row: make test ran its unit tests
    python3.11 scripts/compat.py --list          # the table

For each row, as a user on that runtime would meet the package:

1. the runtime's packages are installed first, at the row's versions (torch from the
   registry is a CUDA build except the newest row's CPU wheel; it runs on CPU);
2. ``pip install <this project>[mlflow,tensorboard,progress]`` is run as a user would run it,
   and must move none of the runtime's packages (any that moved fails the row);
3. pytest, pytest-timeout and torchmetrics (the tests' metrics) are added, every runtime
   package held fixed; so is the ``lightning`` extra where it installs beside them (the
   Lightning tests skip where it does not, and run as ``compat`` on the rows they were checked on);
4. ``pytest -m "compat or not (spark or cluster or slow)" tests`` runs with the virtualenv's
   Python on the executors: every unit test that needs no Spark (about 3 minutes; those of a
   feature the row's torch lacks skip, as its users are refused) and the Spark tests marked
   ``compat``.

Each row's virtualenv is made with its runtime's Python (``Row.python``): 3.11 for 15.4, 16.4
(pandas 1.5.3 has no 3.12 wheel on the registry) and the newest row, 3.12 for 17.3 and 18, found
as ``python3.12`` with ``PYENV_VERSION=3.12.1`` (how these machines' pyenv names it).

Virtualenvs are cached under ``$STE_COMPAT_HOME`` (default ``~/.cache/spark-torch-est/compat``),
one per row, rebuilt when the row's pins change; pip's own cache keeps the wheels. Each row
ends with one summary line; the script exits 1 when any row failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = "mlflow,tensorboard,progress"
TEST_TOOLS = ["pytest>=8,<10", "pytest-timeout>=2.2", "torchmetrics>=1.0,<2"]
#: The tests each row runs: the unit tests (no Spark) and the Spark tests marked ``compat``.
SELECTED = "compat or not (spark or cluster or slow)"
#: The lightning extra, installed where it fits the row's pins (its tests skip where it is not).
LIGHTNING = "lightning>=2.5,<2.7"


@dataclasses.dataclass(frozen=True)
class Row:
    """One environment of the support matrix.

    Args:
        name: Short name used on the command line ("15.4", "newest").
        runtime: What the row stands for.
        spark, torch, pandas, numpy, pyarrow, mlflow: The runtime's versions (DESIGN's table).
        held: Other packages the runtime ships that our extras name, held at these versions.
        python: The runtime's Python (major.minor) the row's virtualenv is made with.
    """

    name: str
    runtime: str
    spark: str
    torch: str
    pandas: str
    numpy: str
    pyarrow: str
    mlflow: str
    held: tuple[tuple[str, str], ...] = ()
    python: str = "3.11"

    def interpreter(self) -> tuple[list[str], dict[str, str]]:
        """The command that runs the row's Python, and the environment it needs (pyenv
        chooses among its installed versions by ``PYENV_VERSION``)."""
        return [f"python{self.python}"], dict(PYENV_VERSIONS.get(self.python, {}))

    def pins(self) -> dict[str, str]:
        return {"pyspark": self.spark, "torch": self.torch, "pandas": self.pandas, "numpy": self.numpy,
                "pyarrow": self.pyarrow, "mlflow": self.mlflow, **dict(self.held)}


#: The environment that makes ``python<version>`` the installed release of that version.
PYENV_VERSIONS = {"3.12": {"PYENV_VERSION": "3.12.1"}}

#: The rows, oldest first. ``held``: tensorboard, tqdm and cloudpickle as the runtimes ship
#: them, and SQLAlchemy below 2.1 where the runtime's mlflow cannot open a sqlite store with 2.1
#: (up to mlflow 3.8).
ROWS = (
    Row("15.4", "Databricks 15.4 LTS ML", "3.5.0", "2.3.1", "1.5.3", "1.23.5", "14.0.1", "2.13.1",
        (("tensorboard", "2.16.2"), ("tqdm", "4.66.4"), ("cloudpickle", "2.2.1"), ("sqlalchemy", "2.0.30"),
         ("fsspec", "2023.5.0"))),
    Row("16.4", "Databricks 16.4 LTS ML", "3.5.2", "2.6.0", "1.5.3", "1.26.4", "15.0.2", "2.21.3",
        (("tensorboard", "2.17.1"), ("tqdm", "4.66.4"), ("cloudpickle", "2.2.1"), ("sqlalchemy", "2.0.30"))),
    Row("17.3", "Databricks 17.3 LTS ML", "4.0.0", "2.7.0", "2.2.3", "2.1.3", "19.0.1", "3.0.1",
        (("tensorboard", "2.19.0"), ("tqdm", "4.67.1"), ("cloudpickle", "3.0.0"), ("sqlalchemy", "2.0.39")),
        python="3.12"),
    Row("18", "Databricks 18 LTS ML", "4.1.0", "2.9.0", "2.2.3", "2.1.3", "21.0.0", "3.8.1",
        (("tensorboard", "2.20.0"), ("tqdm", "4.67.1"), ("cloudpickle", "3.1.1"), ("sqlalchemy", "2.0.39")),
        python="3.12"),
    Row("newest", "newest releases", "4.3.0", "2.13.0", "2.3.3", "2.4.6", "25.0.1", "3.17.2",
        (("tensorboard", "2.21.0"), ("tqdm", "4.67.1"), ("cloudpickle", "3.1.2"))),
)


def home() -> Path:
    return Path(os.environ.get("STE_COMPAT_HOME", Path.home() / ".cache" / "spark-torch-est" / "compat"))


def run(cmd: list[str], log, **kwargs) -> None:
    """Runs a command, its output into the row's log; raises with the log's tail on failure."""
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, **kwargs)
    if done.returncode:
        raise RuntimeError(f"exit {done.returncode}: {' '.join(cmd[:6])} ...")


def installed(python: Path) -> dict[str, str]:
    """name -> version of every distribution in a virtualenv (names normalized)."""
    code = ("import importlib.metadata as m, json; print(json.dumps({d.metadata['Name'].lower().replace('_', '-'):"
            " d.version for d in m.distributions()}))")
    return json.loads(subprocess.check_output([str(python), "-c", code], text=True))


def moved(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return [f"{name} {version} -> {after.get(name, 'removed')}" for name, version in sorted(before.items())
            if after.get(name) != version]


def build(row: Row, venv: Path, log) -> dict[str, str]:
    """The runtime's packages alone, cached by the row's pins; returns what they are."""
    stamp = venv / ".runtime.json"
    key = hashlib.sha256(json.dumps({**row.pins(), "python": row.python}, sort_keys=True).encode()).hexdigest()
    if stamp.exists() and json.loads(stamp.read_text())["key"] == key:
        runtime = json.loads(stamp.read_text())["runtime"]
        if not moved(runtime, installed(venv / "bin" / "python")):  # an earlier failed run may have moved some
            return runtime
    run(["rm", "-rf", str(venv)], log)
    command, env = row.interpreter()
    run([*command, "-m", "venv", str(venv)], log, env={**os.environ, **env})
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], log)
    run([str(python), "-m", "pip", "install", "--quiet", *(f"{n}=={v}" for n, v in row.pins().items())], log)
    runtime = installed(python)
    runtime.pop("pip", None)
    stamp.write_text(json.dumps({"key": key, "runtime": runtime}))
    return runtime


def check_row(row: Row, marks: str, pytest_args: list[str]) -> tuple[bool, str]:
    venv = home() / row.name
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = home() / f"{row.name}.log"
    started = time.monotonic()
    with open(log_path, "w") as log:
        try:
            runtime = build(row, venv, log)
            python = venv / "bin" / "python"
            # As a user installs it: nothing of the runtime may move.
            run([str(python), "-m", "pip", "install", "--quiet", f"{ROOT}[{EXTRAS}]"], log)
            changed = moved(runtime, installed(python))
            if changed:
                return False, f"pip install of the project moved the runtime's packages: {', '.join(changed)}"
            constraints = venv / "runtime-constraints.txt"
            constraints.write_text("".join(f"{n}=={v}\n" for n, v in runtime.items()))
            run([str(python), "-m", "pip", "install", "--quiet", "-c", str(constraints), *TEST_TOOLS], log)
            try:  # as the extra installs it, moving none of the runtime's packages
                run([str(python), "-m", "pip", "install", "--quiet", "-c", str(constraints), LIGHTNING], log)
            except RuntimeError:
                log.write(f"{LIGHTNING} does not install beside this runtime's packages: its tests skip\n")
            env = {**os.environ, "PYSPARK_PYTHON": str(python), "PYSPARK_DRIVER_PYTHON": str(python),
                   "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_CONF_DIR": str(ROOT / "conf")}
            run([str(python), "-m", "pytest", "-m", marks, "-p", "no:cacheprovider", *pytest_args, "tests"],
                log, env=env, cwd=ROOT)
        except RuntimeError as error:
            return False, f"{error} (see {log_path})"
    tail = [line for line in log_path.read_text().splitlines() if " passed" in line or " failed" in line]
    return True, f"{tail[-1].strip('= ') if tail else 'ok'} in {time.monotonic() - started:.0f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", help="row names (default: every row)")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    parser.add_argument("--marks", default=SELECTED, help=f"the tests each row runs (default: {SELECTED!r})")
    parser.add_argument("--pytest", default="", help="extra pytest arguments, e.g. '-k fit -x'")
    args = parser.parse_args()
    by_name = {row.name: row for row in ROWS}
    if args.list:
        for row in ROWS:
            command, env = row.interpreter()
            python = " ".join([*(f"{k}={v}" for k, v in env.items()), *command])
            print(f"{row.name:7} {row.runtime:24} {python:32} " + " ".join(f"{n}=={v}" for n, v in row.pins().items()))
        return 0
    unknown = [name for name in args.rows if name not in by_name]
    if unknown:
        parser.error(f"unknown rows {unknown}; rows are {list(by_name)}")
    results = []
    for row in [by_name[name] for name in args.rows] or ROWS:
        ok, summary = check_row(row, args.marks, args.pytest.split())
        results.append(ok)
        print(f"compat {row.name:7} ({row.runtime}): {'PASSED' if ok else 'FAILED'}: {summary}", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
