"""[driver] Writes the typed Param modules from the table in :mod:`spark_torch_est.params.table`.

As pyspark's ``ml/param/_shared_params_code_gen.py`` writes ``shared.py``: the accessors are
explicit code, so IDEs and type checkers see every ``getX``/``setX`` with its type, and one
table says everything about a Param. Run ``python -m spark_torch_est.params.codegen`` (or
``make params``) after changing the table; ``--check`` only says whether the modules are up
to date (tests/unit/params/test_table.py checks it too).

>>> runtime = sum(p.family == "runtime" for p in PARAMS)  # one getX and one setX each
>>> render("runtime").count("    def get") == render("runtime").count("    def set") == runtime
True
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spark_torch_est.params.table import FAMILIES, PARAMS, ParamSpec

__all__ = ["render", "module_path", "main"]

_WIDTH = 120
_PACKAGE = "spark_torch_est"
_TABLE_MODULE = f"{_PACKAGE}.params.table"


def module_path(family: str) -> Path:
    """Where the module of ``family`` (a key of ``FAMILIES``) lives: ``<folder>/<module>.py``."""
    spec = FAMILIES[family]
    return Path(__file__).resolve().parents[1] / spec.folder / f"{spec.module}.py"


def render(family: str) -> str:
    """The source of the module of ``family``: its Params, their defaults and accessors."""
    spec = FAMILIES[family]
    params = [p for p in PARAMS if p.family == family]
    names = {_converter(p.converter) for p in params}
    converters = sorted(name for name in names if "." not in name)
    typing_names = (["Any"] if any("Any" in p.type for p in params) else []) \
        + (["TYPE_CHECKING"] if spec.type_imports else []) + ["TypeVar"]
    pyspark_names = ["Param", "Params"] + (["TypeConverters"] if len(converters) < len(names) else [])
    carried = " and ".join(spec.carried_by)
    lines = [
        f'"""[driver] {spec.cls}: {spec.doc}.',
        "",
        f"Params of {carried}, their defaults and typed accessors. GENERATED from the table in",
        "spark_torch_est/params/table.py by ``make params`` (``python -m spark_torch_est.params.codegen``):",
        "do not edit by hand; tests/unit/params/test_table.py fails while this file is stale. See docs/params.md.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        *(["import copy"] if any(p.copy for p in params) else []),
        f"from typing import {', '.join(typing_names)}",
        "",
        f"from pyspark.ml.param import {', '.join(pyspark_names)}",
        "",
        *([*_import_lines(_TABLE_MODULE, converters), ""] if converters else []),
        *(["if TYPE_CHECKING:", *_type_imports(spec.type_imports), ""] if spec.type_imports else []),
        f'__all__ = ["{spec.cls}"]',
        "",
        '_P = TypeVar("_P", bound=Params)',
        "",
        "",
        f"class {spec.cls}(Params):",
        *_docstring(f"Params of {carried}: {spec.doc}."),
        "",
    ]
    for param in params:
        lines += _declaration(param)
    lines += ["", "    def __init__(self) -> None:", "        super().__init__()", "        self._setDefault("]
    lines += [f"            {p.name}={_value(p.default)}," for p in params if not p.required]
    lines += ["        )", ""]
    for param in params:
        lines += _accessors(param)
    return "\n".join(lines).rstrip("\n") + "\n"


def _docstring(text: str) -> list[str]:
    """The class docstring ``text``, on one line where it fits, else wrapped."""
    if len(text) + 10 <= _WIDTH:
        return [f'    """{text}"""']
    lines = textwrap.wrap(text, width=_WIDTH - 10, break_long_words=False, break_on_hyphens=False)
    return [f'    """{lines[0]}', *(f"    {line}" for line in lines[1:]), '    """']


def _import_lines(module: str, names: list[str]) -> list[str]:
    """``from module import names`` on one line, or one name a line where that is over 120
    characters (as ruff's isort writes it)."""
    line = f"from {module} import {', '.join(names)}"
    if len(line) <= 120:
        return [line]
    return [f"from {module} import (", *(f"    {name}," for name in names), ")"]


def _type_imports(imports: tuple[str, ...]) -> list[str]:
    """The imports under ``if TYPE_CHECKING:``, others' before this package's, as isort orders them."""
    others = sorted(line for line in imports if not line.startswith(f"from {_PACKAGE}"))
    own = sorted(line for line in imports if line.startswith(f"from {_PACKAGE}"))
    return [f"    {line}" for line in others] + ([""] if others and own else []) + [f"    {line}" for line in own]


def _declaration(param: ParamSpec) -> list[str]:
    chunks = textwrap.wrap(param.doc, width=_WIDTH - 12, break_long_words=False, break_on_hyphens=False)
    if " ".join(chunks) != param.doc:
        raise ValueError(f"the doc of {param.name} has runs of whitespace: {param.doc!r}")
    doc = [_literal(chunk + (" " if i < len(chunks) - 1 else "")) for i, chunk in enumerate(chunks)]
    return [f"    {param.name}: Param = Param(",
            f'        Params._dummy(), "{param.name}",',
            *(f"        {chunk}" for chunk in doc[:-1]),
            f"        {doc[-1]},",
            f"        typeConverter={_converter(param.converter)},",
            "    )"]


def _accessors(param: ParamSpec) -> list[str]:
    cap = param.name[0].upper() + param.name[1:]
    value = f"self.getOrDefault(self.{param.name})"
    if param.copy:
        got = f'        """Gets a copy of the value of {param.name} or of its default, ``{_value(param.default)}`` ' \
              '(changing it changes nothing)."""'
        value = f"copy.deepcopy({value})"
    elif param.required:
        got = f'        """Gets the value of {param.name} (it has no default)."""'
    else:
        got = f'        """Gets the value of {param.name} or its default, ``{_value(param.default)}``."""'
    return [f"    def get{cap}(self) -> {param.type}:", got, f"        return {value}", "",
            f"    def set{cap}(self: _P, value: {param.type}) -> _P:",
            f'        """Sets the value of {param.name}."""',
            f"        return self._set({param.name}=value)", ""]


def _converter(converter: Callable[[Any], Any]) -> str:
    """How the generated module names ``converter``."""
    qualname = getattr(converter, "__qualname__", "")
    if qualname.startswith("TypeConverters."):
        return qualname
    if getattr(converter, "__module__", None) == _TABLE_MODULE and "." not in qualname:
        return qualname
    raise ValueError(f"converter {converter!r}: use a TypeConverters method or a converter of {_TABLE_MODULE}")


def _value(value: object) -> str:
    """``value`` as Python source, strings in double quotes."""
    return _literal(value) if isinstance(value, str) else repr(value)


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main(argv: list[str] | None = None) -> int:
    """Writes every family's module (``--check``: only reports the stale ones, exit status 1)."""
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = []
    for family in FAMILIES:
        path, text = module_path(family), render(family)
        if not path.exists() or path.read_text() != text:
            stale.append(path.name)
            if not check:
                path.write_text(text)
    verb = "stale" if check else "written"
    sys.stdout.write(f"{verb}: {', '.join(stale)}\n" if stale else "up to date\n")  # a command-line tool
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
