"""The package's shape: every module says which side runs it, executors never import the driver side."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "spark_torch_est"
TAG = re.compile(r'^"""\[(driver|executor|both)\] ')


def _side(path: Path) -> str:
    match = TAG.match(path.read_text())
    assert match, f"{path.name}: the module docstring must start with [driver], [executor] or [both]"
    return match.group(1)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions (not those
    only type checkers see)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "spark_torch_est":
                names.update(f"spark_torch_est.{alias.name}" for alias in node.names)
    return names


MODULES = sorted(PACKAGE.glob("*.py"))
SIDES = {path.stem: _side(path) for path in MODULES}


@pytest.mark.parametrize("path", [p for p in MODULES if SIDES[p.stem] != "driver"], ids=lambda p: p.stem)
def test_executor_modules_never_import_the_driver_side(path):
    for name in _imports(path):
        assert not name.startswith("pyspark.ml"), f"{path.name} imports {name}"
        if name.startswith("spark_torch_est."):
            assert SIDES[name.split(".")[1]] != "driver", f"{path.name} ({SIDES[path.stem]}) imports {name}"


def test_no_collective_that_unpickles_what_peers_send():
    for path in MODULES:
        found = re.findall(r"\b(all_gather_object|broadcast_object_list|gather_object|scatter_object_list|"
                           r"recv_object_list|send_object_list)\b", path.read_text())
        assert not found, f"{path.name} uses {found}: peers' objects would be unpickled"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_the_examples_in_docstrings_run(path):
    import doctest
    import importlib

    module = importlib.import_module(f"spark_torch_est.{path.stem}" if path.stem != "__init__" else "spark_torch_est")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0 or ">>>" not in path.read_text()
