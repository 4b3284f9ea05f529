import pytest

from spark_torch_est import Duration
from spark_torch_est.errors import InvalidInputError


@pytest.mark.parametrize("text, value, unit", [("3ep", 3, "ep"), (" 150ba ", 150, "ba"), ("1 ep", 1, "ep"),
                                               ("100000sp", 100000, "sp"), ("4_000ba", 4000, "ba"),
                                               ("1_000_000sp", 1000000, "sp")])
def test_parse(text, value, unit):
    assert Duration.parse(text) == Duration(value, unit)


@pytest.mark.parametrize("text", ["", "3", "ep", "0ep", "-1ep", "1.5ep", "3 epochs", "3EP", None, 3, "_4ba",
                                  "4_ba", "4__000ba", "0_000sp", "5samples"])
def test_bad_durations_quote_the_input(text):
    with pytest.raises(InvalidInputError) as error:
        Duration.parse(text, what="duration")
    assert repr(text) in str(error.value)
    assert "'3ep'" in str(error.value)


def test_str_round_trips():
    assert str(Duration.parse("42ba")) == "42ba"
