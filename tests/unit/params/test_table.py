"""The Params: one table, the typed accessors generated from it, the estimator's signature and
docstring that agree with it, and the types a user's code sees (py.typed, fit's overloads)."""

from __future__ import annotations

import inspect
import re
import textwrap
from pathlib import Path

import pytest

from spark_torch_est import TorchEstimator, TorchModel
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.params.codegen import module_path, render
from spark_torch_est.params.table import ESTIMATOR_PARAMS, FAMILIES, PARAMS
from spark_torch_est.planning import check_params
from spark_torch_est.tuning import SuccessiveHalving

PACKAGE = Path(__file__).resolve().parents[3] / "spark_torch_est"


@pytest.mark.parametrize("stage", [TorchEstimator, TorchModel])
def test_every_param_has_getx_and_setx_with_types_a_checker_sees(stage):
    for param in stage().params:
        cap = param.name[0].upper() + param.name[1:]
        for method in (f"get{cap}", f"set{cap}"):
            declared = next((vars(c)[method] for c in stage.__mro__ if method in vars(c)), None)
            assert declared is not None and "return" in declared.__annotations__, \
                f"{stage.__name__}.{method} must be declared with types (generated from params/table.py)"


def test_a_type_checker_sees_fit_return_a_model_or_a_list_and_typed_accessors(tmp_path):
    api = pytest.importorskip("mypy.api")
    assert (PACKAGE / "py.typed").exists()
    user = tmp_path / "user.py"
    user.write_text(textwrap.dedent("""
        from pyspark.sql import DataFrame
        from spark_torch_est import TorchEstimator

        def train(df: DataFrame) -> None:
            est = TorchEstimator()
            reveal_type(est.fit(df))
            reveal_type(est.fit(df, [{est.batchSize: 32}]))
            reveal_type(est.setBatchSize(32))
            reveal_type(est.getCheckpointDir())
            est.setMaxEpochs("3")
    """))
    out, _, status = api.run([str(user), "--follow-imports=silent", "--ignore-missing-imports",
                              "--config-file=", "--no-error-summary"])
    lines = [line.split(": ", 1)[1].replace("builtins.", "") for line in out.splitlines()]  # as mypy 1 and 2 write
    assert lines == [
        'note: Revealed type is "spark_torch_est.model.TorchModel"',
        'note: Revealed type is "list[spark_torch_est.model.TorchModel]"',
        'note: Revealed type is "spark_torch_est.estimator.TorchEstimator"',
        'note: Revealed type is "str | None"',
        'error: Argument 1 to "setMaxEpochs" of "TrainingParams" has incompatible type "str"; expected "int"  '
        '[arg-type]',
    ], out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_generated_param_modules_are_up_to_date_with_the_table(family):
    assert module_path(family).read_text() == render(family), \
        f"{module_path(family).name} is stale: run `make params` (python -m spark_torch_est.params.codegen)"


@pytest.mark.parametrize("stage", [TorchEstimator, TorchModel, SuccessiveHalving])
def test_each_stage_carries_the_params_of_its_families_with_their_defaults(stage):
    expected = {p.name: p.default for p in PARAMS if stage.__name__ in FAMILIES[p.family].carried_by and not p.required}
    instance = stage()
    shared = {"seed", "parallelism"} if stage is SuccessiveHalving else set()  # pyspark's shared Params
    assert {p.name: instance.getOrDefault(p) for p in instance.params
            if instance.hasDefault(p) and p.name not in shared} == expected
    required = {p.name for p in PARAMS if stage.__name__ in FAMILIES[p.family].carried_by and p.required}
    assert required <= {p.name for p in instance.params} and not any(instance.isDefined(name) for name in required)


_CREATOR_ARGS = {"model", "optimizer", "loss", "scheduler", "metrics", "hooks", "callbacks", "loggers"}


def _assert_same_names(names: set[str], where: str) -> None:
    table = {p.name for p in ESTIMATOR_PARAMS}
    assert names == table, f"only in {where}: {sorted(names - table)}; only in the table: {sorted(table - names)}"


def test_the_estimators_signature_agrees_with_the_table():
    signature = inspect.signature(TorchEstimator.__init__).parameters
    _assert_same_names(set(signature) - {"self"} - _CREATOR_ARGS, "TorchEstimator.__init__")
    for spec in ESTIMATOR_PARAMS:
        argument = signature[spec.name]
        assert argument.kind is inspect.Parameter.KEYWORD_ONLY, spec.name
        if isinstance(spec.default, (dict, list)):  # a mutable default: None stands for it, any Mapping is taken
            assert argument.default is None, spec.name
            continue
        assert (type(argument.default), argument.default) == (type(spec.default), spec.default), spec.name
        assert argument.annotation == spec.type, spec.name


def _documented(value: object) -> str:
    """A default as the docstring writes it: ``"1ep"``, ``{}``, None, 600 (not 600.0)."""
    if isinstance(value, str):
        return f'``"{value}"``'
    if isinstance(value, (dict, list)):
        return f"``{value}``"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_the_estimators_docstring_documents_every_param_with_its_default():
    args = inspect.getdoc(TorchEstimator).split("Args:\n", 1)[1]
    entries = {m["name"]: " ".join(m["text"].split())
               for m in re.finditer(r"^    (?P<name>\w+): (?P<text>.*(?:\n        .*)*)", args, re.MULTILINE)}
    _assert_same_names(set(entries) - _CREATOR_ARGS, "TorchEstimator's docstring")
    for spec in ESTIMATOR_PARAMS:
        assert f"(default {_documented(spec.default)}" in entries[spec.name], (spec.name, entries[spec.name])


@pytest.mark.parametrize("spec", [p for p in ESTIMATOR_PARAMS if p.minimum is not None or p.seconds or p.choices],
                         ids=lambda p: p.name)
def test_each_bound_the_table_declares_is_refused_before_a_fit(spec, tmp_path):
    """A row's ``minimum``, ``seconds`` or ``choices`` is all it takes for fit to refuse a value
    out of bounds, naming the Param and the value."""
    if spec.minimum is not None:
        below, message = spec.minimum - 1, f"{spec.name} must be at least {spec.minimum}, got {spec.minimum - 1}"
    elif spec.seconds:
        below, message = 0.0, f"{spec.name} must be a positive number of seconds, got 0.0"
    else:
        below, message = "nope", f"{spec.name} must be one of .*, got 'nope'"
    est = TorchEstimator(checkpointDir=str(tmp_path))
    check_params(est.copy({est.getParam(spec.name): spec.default}))  # the default is within bounds
    with pytest.raises(InvalidInputError, match=message):
        check_params(est.copy({est.getParam(spec.name): below}))


def test_a_fitted_model_holds_its_estimators_params_declared_by_its_class():
    """TorchModel shares the estimator's Params class (as a pyspark.ml model does): fit sets
    the values it was trained with; no Param is declared for one instance only."""
    from pyspark.ml.param import Param

    from spark_torch_est.params.base import carry_params

    est, model = TorchEstimator(batchSize=32, strategy="fsdp"), TorchModel()
    carry_params(est, model)
    assert {p.name for p in model.params} == {p.name for p in est.params}
    assert (model.getBatchSize(), model.getStrategy(), model.getMaxEpochs()) == (32, "fsdp", 10)
    assert model.isSet("batchSize") and not model.isSet("maxEpochs")
    assert not [p.name for p in est.params if not isinstance(getattr(TorchModel, p.name, None), Param)]
