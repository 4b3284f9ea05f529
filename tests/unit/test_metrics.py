"""One accumulator for validation and evaluate(): exact when parts are combined."""

import pytest
import torch
import torchmetrics

from spark_torch_est.train.metrics import MetricAccumulator, is_stateful

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
