"""The loop's vocabulary: the stage a failure names, and the batch hooks may replace."""

from __future__ import annotations

import pytest
import torch

from spark_torch_est.train.step import Batch, Stage


def test_a_stage_comes_back_when_its_region_ends_and_stays_when_it_raises():
    stage = Stage("setup")
    with stage.at("train"):
        with stage.at("forward"):
            assert stage.name == "forward"
        assert stage.name == "train"
    assert stage.name == "setup"
    with pytest.raises(ValueError):
        with stage.at("train"):
            with stage.at("loss"):
                raise ValueError("boom")
    assert stage.name == "loss"


def test_a_replaced_batch_keeps_its_weights_and_offers_the_new_inputs_and_labels():
    weights = torch.ones(2)
    batch = Batch(torch.zeros(2, 3), torch.zeros(2, 1), weights).replaced([torch.ones(2, 3), torch.ones(2, 1)])
    arguments = batch.arguments()
    assert arguments["weights"] is weights and arguments["batch"] == (arguments["inputs"], arguments["labels"])
    assert float(arguments["inputs"].sum()) == 6
