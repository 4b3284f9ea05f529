"""One accumulator for validation and evaluate(): exact when parts are combined."""

import pytest
import torch
import torchmetrics

from spark_torch_est import TorchEstimator
from spark_torch_est.errors import InvalidInputError, UserCodeError
from spark_torch_est.train.metrics import MetricAccumulator, is_stateful
from tests.helpers import adam, mlp

CPU = torch.device("cpu")


def _mae(outputs, labels):
    return (outputs - labels).abs().mean()


def _accumulator():
    return MetricAccumulator(torch.nn.MSELoss(), {"mae": _mae, "mse": torchmetrics.MeanSquaredError()}, CPU)


def test_parts_combine_to_the_whole_exactly():
    torch.manual_seed(0)
    outputs, labels = torch.randn(50, 1), torch.randn(50, 1)
    whole = _accumulator()
    for start in (0, 16, 32, 48):  # uneven batches: means weighted by rows
        whole.update(outputs[start:start + 16], labels[start:start + 16])
    expected = whole.results(whole.totals())
    parts = [_accumulator(), _accumulator()]
    parts[0].update(outputs[:7], labels[:7])
    parts[1].update(outputs[7:], labels[7:])
    merged = _accumulator()
    for part in parts:
        for name, blob in zip(part.names, part.states()):
            if blob:
                merged.merge(name, blob)
    combined = merged.results(parts[0].totals() + parts[1].totals())
    assert combined == pytest.approx(expected, rel=1e-6)
    assert expected["loss"] == pytest.approx(float(((outputs - labels) ** 2).mean()), rel=1e-6)
    assert expected["mse"] == pytest.approx(expected["loss"], rel=1e-6)


def test_stateful_means_update_and_compute():
    assert is_stateful(torchmetrics.MeanSquaredError()) and not is_stateful(_mae)


def test_a_stateful_metric_that_cannot_merge_says_so():
    class Counter:
        def __init__(self):
            self.n = 0
            self.metric_state = {"n": torch.tensor(0)}

        def update(self, outputs, labels):
            self.n += len(outputs)

        def compute(self):
            return self.n

    accumulator = MetricAccumulator(torch.nn.MSELoss(), {"count": Counter()}, CPU)
    with pytest.raises(TypeError, match="no merge_state"):
        accumulator.merge("count", _accumulator().states()[1])


class Several(torchmetrics.MeanSquaredError):
    """A stateful metric whose compute() gives a dict, as a MetricCollection does."""

    def compute(self):
        return {"mse": super().compute(), "count": self.total}


def test_a_stateful_metric_whose_compute_gives_a_dict_is_named_with_what_was_expected():
    accumulator = MetricAccumulator(torch.nn.MSELoss(), {"both": Several()}, CPU)
    accumulator.update(torch.zeros(4, 1), torch.ones(4, 1))
    with pytest.raises(UserCodeError) as error:
        accumulator.results(accumulator.totals())
    assert str(error.value).startswith("metric 'both' (Several).compute() returned a dict with keys 'mse', 'count'; "
                                       "expected a number or a tensor holding one value")
    assert "one metric per value" in str(error.value)


@pytest.mark.parametrize("metrics, words", [
    ({"acc": 0.5}, "metrics['acc'] must be a callable(outputs, labels) -> number or a stateful metric"),
    ({3: _mae}, "the name 3 is not a string"),
    ([_mae], "metrics must be a {name: metric} dict, got list"),
])
def test_metrics_that_cannot_be_called_are_refused_when_the_estimator_is_made(metrics, words):
    with pytest.raises(InvalidInputError) as error:
        TorchEstimator(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(), metrics=metrics)
    assert words in str(error.value)
