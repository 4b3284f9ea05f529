import pytest

from spark_torch_est import Duration
from spark_torch_est.errors import InvalidInputError


@pytest.mark.parametrize("text, value, unit", [("3ep", 3, "ep"), (" 150ba ", 150, "ba"), ("1 ep", 1, "ep")])
def test_parse(text, value, unit):
    assert Duration.parse(text) == Duration(value, unit)


@pytest.mark.parametrize("text", ["", "3", "ep", "0ep", "-1ep", "1.5ep", "3 epochs", "3EP", None, 3])
def test_bad_durations_quote_the_input(text):
    with pytest.raises(InvalidInputError) as error:
        Duration.parse(text, what="duration")
    assert repr(text) in str(error.value)
    assert "'3ep'" in str(error.value)


def test_str_round_trips():
    assert str(Duration.parse("42ba")) == "42ba"
