"""The package's shape: every module says which side runs it, executors never import the driver side,
and no module imports itself back through others."""

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


def _name(path: Path) -> str:
    """The dotted name of one of the package's modules (a folder's ``__init__`` is the folder)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
SIDES = {name: _side(path) for name, path in MODULES.items()}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions (not those
    only type checkers see); ``from p import m`` imports the module ``p.m`` where the
    package has one, else ``p``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                         for alias in node.names)
    return names


def _with_packages(name: str) -> list[str]:
    """``name`` and the packages above it: importing a module runs each of their ``__init__``."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1)]


@pytest.mark.parametrize("name", [name for name in MODULES if SIDES[name] != "driver"])
def test_executor_modules_never_import_the_driver_side(name):
    for imported in _imports(MODULES[name]):
        assert not imported.startswith("pyspark.ml"), f"{name} imports {imported}"
        for module in _with_packages(imported) if imported.startswith("spark_torch_est") else []:
            assert SIDES[module] != "driver", f"{name} ({SIDES[name]}) imports {imported} ({module} is driver side)"


def test_no_import_circle():
    """No module imports, however indirectly, a module that imports it back; the package
    root's names, imported on first use, count as imports of the modules they live in."""
    import spark_torch_est

    graph = {name: sorted(imported for imported in _imports(path) if imported in MODULES and imported != name)
             for name, path in MODULES.items()}
    graph["spark_torch_est"] += sorted({f"spark_torch_est.{home}" for home in spark_torch_est._HOMES.values()})
    finished: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            pytest.fail("import circle: " + " -> ".join(trail[trail.index(name):] + [name]))
        if name not in finished:
            for imported in graph[name]:
                visit(imported, trail + [name])
            finished.add(name)

    for name in graph:
        visit(name, [])


def test_no_collective_that_unpickles_what_peers_send():
    for path in MODULES.values():
        found = re.findall(r"\b(all_gather_object|broadcast_object_list|gather_object|scatter_object_list|"
                           r"recv_object_list|send_object_list)\b", path.read_text())
        assert not found, f"{path.name} uses {found}: peers' objects would be unpickled"


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_in_docstrings_run(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0 or ">>>" not in MODULES[name].read_text()


def test_only_jvm_py_reaches_into_sparks_jvm_or_pyspark_internals():
    """Every py4j handle and private pyspark call goes through one module, which the support
    matrix checks on every Spark release it lists."""
    reach = re.compile(r"\._(?:jvm|jsc|jdf|jsparkSession|jconf|gateway|collect_as_arrow)\b")
    for name, path in MODULES.items():
        if name != "spark_torch_est.core.jvm":
            found = reach.findall(path.read_text())
            assert not found, f"{name} reaches into Spark's JVM ({found}): go through spark_torch_est.core.jvm"


def _unit(name: str) -> str:
    """The folder a module lives in under the package, or the top-level module itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


FOLDERS = sorted({path.parent.relative_to(PACKAGE).parts[0] for path in PACKAGE.rglob("*/__init__.py")})


def test_folders_by_concept_and_few_modules_at_the_top():
    concepts = {"core", "params", "ingest", "train", "checkpoints", "cluster", "scoring", "tuning", "loggers"}
    assert concepts <= set(FOLDERS)
    top = sorted(path.stem for path in PACKAGE.glob("*.py"))
    assert len(top) <= 12, f"{len(top)} modules at the top ({top}): each belongs in the folder of its concept"
    assert {path.stem for path in (PACKAGE / "train" / "strategies").glob("*.py")} >= {"ddp", "fsdp"}


def test_no_import_circle_between_folders():
    """Folders (and the top-level modules) import each other in one direction only: ``core``
    below everything, the estimator and the model above the parts they put together."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name == "spark_torch_est":
            continue
        graph.setdefault(_unit(name), set()).update(
            _unit(imported) for imported in _imports(path)
            if imported.startswith("spark_torch_est.") and _unit(imported) != _unit(name))
    finished: set[str] = set()

    def visit(unit: str, trail: list[str]) -> None:
        if unit in trail:
            pytest.fail("circle between folders: " + " -> ".join(trail[trail.index(unit):] + [unit]))
        if unit not in finished:
            for imported in sorted(graph.get(unit, ())):
                visit(imported, trail + [unit])
            finished.add(unit)

    for unit in sorted(graph):
        visit(unit, [])
    assert not {unit for unit in graph.get("core", ()) if unit in FOLDERS}, "core imports another folder"


#: docs/architecture.md's layers: what each lower folder may import (errors.py aside); the
#: estimator, the model, planning, persistence, tuning and loggers sit on top.
_BELOW = {"core": set(), "params": {"core"}, "checkpoints": {"core"}, "ingest": {"core"},
          "train": {"core", "ingest", "checkpoints"}}
_BELOW |= dict.fromkeys(("cluster", "scoring"), {"core", "params", "checkpoints", "ingest", "train"})


@pytest.mark.parametrize("folder", sorted(_BELOW))
def test_folders_depend_downwards_as_the_architecture_note_says(folder):
    imported = {_unit(name) for module, path in MODULES.items() if _unit(module) == folder
                for name in _imports(path) if name.startswith("spark_torch_est.")} - {folder, "errors"}
    assert imported <= _BELOW[folder], f"{folder} imports {sorted(imported - _BELOW[folder])}: see docs/architecture.md"


UNIT = Path(__file__).resolve().parent
# The tests in tests/unit/ that test no module of the package, each with what it tests instead.
NOT_A_MODULE = {
    "test_package.py": "the package's shape as a whole (this file)",
    "test_benchmarks.py": "benchmarks/, beside the package",
    "test_compat_script.py": "scripts/compat.py, beside the package",
}


def test_unit_tests_mirror_the_package():
    """``tests/unit/<folder>/test_<module>.py`` tests ``spark_torch_est/<folder>/<module>.py`` (or
    the package ``<module>/``; the top-level modules' tests sit in ``tests/unit/``), so a module's
    tests are found by its path; each test folder is a package, since two folders may hold files
    of one name."""
    wrong = []
    for path in sorted(UNIT.rglob("test_*.py")):
        folder = path.parent.relative_to(UNIT)
        module = PACKAGE / folder / f"{path.stem.removeprefix('test_')}.py"
        package = module.with_suffix("") / "__init__.py"  # a module that is a folder (train/lightning/)
        if not module.is_file() and not package.is_file() and not (folder == Path(".") and path.name in NOT_A_MODULE):
            wrong.append(f"{path.relative_to(UNIT.parent.parent)}: no module {module.relative_to(PACKAGE.parent)}")
    for folder in sorted({path.parent for path in UNIT.rglob("test_*.py")}):
        if not (folder / "__init__.py").is_file():
            wrong.append(f"{folder.relative_to(UNIT.parent.parent)} has no __init__.py")
    assert not wrong, "tests/unit mirrors the package (docs/architecture.md):\n" + "\n".join(wrong)


def test_old_module_names_resolve_only_while_a_saved_stage_is_loaded():
    """Importing the package installs nothing on sys.meta_path, so an old name does not import
    (and never shadows a new one); a pickle naming old module paths loads through
    ``moved.loads``, as their homes now, with one warning."""
    import subprocess
    import sys

    probe = (
        "import sys, importlib\n"
        "import spark_torch_est, spark_torch_est.estimator, spark_torch_est.model\n"
        "ours = [f for f in sys.meta_path if type(f).__module__.startswith('spark_torch_est')]\n"
        "print('added', ours)\n"
        "for old in ('builtin_hooks', 'columns', 'worker'):\n"
        "    try:\n"
        "        importlib.import_module('spark_torch_est.' + old)\n"
        "        print('imported', old)\n"
        "    except ModuleNotFoundError:\n"
        "        print('absent', old)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.split("\n")[:4] == ["added []", "absent builtin_hooks", "absent columns", "absent worker"], (
        out.stdout + out.stderr)


def test_a_pickle_of_old_module_paths_loads_as_their_homes_now_with_one_warning(caplog):
    import importlib
    import logging
    import pickle

    import cloudpickle

    from spark_torch_est import moved
    from spark_torch_est.train.builtin_hooks import EarlyStopping, GradientClipping

    for new in moved.MOVED.values():
        importlib.import_module(f"spark_torch_est.{new}")  # every home exists
    saved = pickle.dumps([EarlyStopping(), GradientClipping(1.0)], protocol=0)
    old = saved.replace(b"spark_torch_est.train.builtin_hooks", b"spark_torch_est.builtin_hooks")
    assert old != saved
    with caplog.at_level(logging.WARNING, logger="spark_torch_est.moved"):
        hooks = moved.loads(old, "saved/torch/creators.pkl")
        assert [type(hook) for hook in hooks] == [EarlyStopping, GradientClipping]
        assert moved.loads(saved, "new.pkl")[0].__class__ is EarlyStopping
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith(
        "saved/torch/creators.pkl names modules by their 0.1.0 paths (spark_torch_est.builtin_hooks)")
    # a function pickled by value that refers to an old module (cloudpickle's subimport)
    module_ref = cloudpickle.dumps(importlib.import_module("spark_torch_est.train.builtin_hooks"), protocol=0)
    by_value = module_ref.replace(b"spark_torch_est.train.builtin_hooks", b"spark_torch_est.builtin_hooks")
    assert moved.loads(by_value, "f.pkl") is importlib.import_module("spark_torch_est.train.builtin_hooks")
    # what was loaded pickles under the new names (the creators shipped to the executors)
    assert b"spark_torch_est.builtin_hooks" not in cloudpickle.dumps(hooks)
