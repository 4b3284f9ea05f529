"""The Params' typed accessors, and the types a user's code sees (py.typed, fit's overloads)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from spark_torch_est import TorchEstimator, TorchModel

PACKAGE = Path(__file__).resolve().parents[2] / "spark_torch_est"


@pytest.mark.parametrize("stage", [TorchEstimator, TorchModel])
def test_every_param_has_getx_and_setx_with_types_a_checker_sees(stage):
    for param in stage().params:
        cap = param.name[0].upper() + param.name[1:]
        for method in (f"get{cap}", f"set{cap}"):
            declared = next((vars(c)[method] for c in stage.__mro__ if method in vars(c)), None)
            assert declared is not None and "return" in declared.__annotations__, \
                f"{stage.__name__}.{method} must be declared with types in params.py (not only generated)"


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
        'error: Argument 1 to "setMaxEpochs" of "EstimatorParams" has incompatible type "str"; expected "int"  '
        '[arg-type]',
    ], out
