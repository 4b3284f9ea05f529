"""The one message ranks send the driver: each kind survives the trip through JSON, and
what the driver cannot read is refused in one way."""

from __future__ import annotations

import json
import logging

import pytest

from spark_torch_est.cluster.messages import Kind, RankMessage
from spark_torch_est.core.progress import Progress


@pytest.mark.parametrize("message", [
    RankMessage.for_step(Progress(epoch=1, batch_in_epoch=3, global_step=13, samples=208, sample_in_epoch=48), 0.125,
                         steps_per_epoch=10),
    RankMessage.for_epoch({"epoch": 2, "train_loss": 0.5, "val_loss": float("nan"), "note": "text"}),
    RankMessage.for_log(1, logging.WARNING, "user", "hello"),
    RankMessage.for_run_done(2, Progress(epoch=3, global_step=30, samples=960), "ab" * 32),
], ids=lambda message: message.kind.value)
def test_each_kind_arrives_as_it_was_sent(message):
    received = RankMessage.from_dict(json.loads(json.dumps(message.to_dict())))
    assert received.kind is message.kind and received.time == message.time
    assert (received.progress, received.steps_per_epoch, received.loss) == (
        message.progress, message.steps_per_epoch, message.loss)
    assert json.dumps(received.entry) == json.dumps(message.entry)  # NaN is not equal to itself
    assert (received.rank, received.run, received.level, received.logger, received.text) == (
        message.rank, message.run, message.level, message.logger, message.text)


@pytest.mark.parametrize("data", [
    {"type": "progress", "global_step": 3, "time": 0.0},  # no loss, no steps_per_epoch
    {"type": "progress", "global_step": [3], "steps_per_epoch": 10, "loss": 0.5, "time": 0.0},
    {"type": "progress", "global_step": 3, "steps_per_epoch": 10, "loss": "0.5", "time": 0.0},
    {"type": "epoch", "entry": {"train_loss": 0.5}, "time": 0.0},  # no epoch number
    {"type": "epoch", "entry": {"epoch": True}, "time": 0.0},
    {"type": "epoch", "entry": [["epoch", 1]], "time": 0.0},
    {"type": "log", "rank": 0, "level": "WARNING", "logger": "x", "message": "m", "time": 0.0},
    {"type": "log", "rank": 0, "level": 30, "logger": "x", "message": "m"},  # no time
    {"type": "run_done", "global_step": 3, "sha256": "", "time": 0.0},  # which run ended
    {"type": "run_done", "global_step": 3, "run": "1", "sha256": "", "time": 0.0},
    {"type": "run_done", "global_step": 3, "run": 1, "sha256": None, "time": 0.0},
    {"type": "blob", "time": 0.0}, {"type": ["progress"]}, {}, [], "progress", None,
])
def test_what_the_driver_cannot_read_is_a_value_error(data):
    with pytest.raises(ValueError, match="not a message the driver can read"):
        RankMessage.from_dict(data)


def test_the_fields_of_other_kinds_keep_their_defaults():
    message = RankMessage.for_epoch({"epoch": 1})
    assert message.kind is Kind.EPOCH and message.progress == Progress() and message.text == ""
    assert message.to_dict().keys() == {"type", "entry", "time"}
