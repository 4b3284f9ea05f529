"""scripts/compat.py's row table: each row's virtualenv is made with its runtime's Python
(checked without building any row: a build is about 5 GB)."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "compat.py"


def _compat():
    spec = importlib.util.spec_from_file_location("compat", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["compat"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_each_row_runs_on_its_runtimes_python():
    rows = {row.name: row.python for row in _compat().ROWS}
    assert rows == {"15.4": "3.11", "16.4": "3.11", "17.3": "3.12", "18": "3.12", "newest": "3.11"}


@pytest.mark.parametrize("name", ["15.4", "17.3"])
def test_a_rows_interpreter_command_starts_that_python(name):
    row = next(row for row in _compat().ROWS if row.name == name)
    command, env = row.interpreter()
    if shutil.which(command[0]) is None:
        pytest.skip(f"{command[0]} is not installed here")
    done = subprocess.run([*command, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    assert done.stdout.strip() == row.python, done.stderr


def test_the_listing_shows_each_rows_python_and_builds_nothing(tmp_path):
    done = subprocess.run(["python3", str(SCRIPT), "--list"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "STE_COMPAT_HOME": str(tmp_path)})
    lines = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert "PYENV_VERSION=3.12.1 python3.12" in lines["17.3"] and "python3.12" in lines["18"]
    assert "python3.11" in lines["15.4"] and not list(tmp_path.iterdir())
