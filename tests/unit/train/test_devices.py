"""Which device a task uses: Spark's GPU address mapped through CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import logging

import pytest
import torch

from spark_torch_est.errors import InputDataError
from spark_torch_est.train.devices import TaskGpu, choose_device, cpu_despite_gpus, task_gpu, task_gpus, to_cpu


@pytest.mark.parametrize("use_gpu, gpus, cuda, rank, visible, expected", [
    (None, [], 0, 0, None, "cpu"),                 # auto on a CPU executor
    (None, ["0"], 0, 1, None, "cpu"),              # Spark has GPU resources, torch has no CUDA build
    (False, ["1"], 2, 0, None, "cpu"),             # switched off
    (None, ["1"], 2, 0, None, "cuda:1"),           # the GPU Spark assigned this task
    (True, ["3"], 4, 1, None, "cuda:3"),
    (True, [], 2, 3, None, "cuda:1"),              # no task resources: one GPU per rank, round robin
    (None, ["1"], 2, 0, "4,6", "cuda:1"),          # address 1 = the second GPU the executor sees (6), cuda:1 here
    (None, ["0"], 1, 0, "3", "cuda:0"),
])
def test_each_task_takes_the_gpu_spark_assigned(use_gpu, gpus, cuda, rank, visible, expected):
    assert choose_device(use_gpu, gpus, cuda, rank, visible) == torch.device(expected)


@pytest.mark.parametrize("addresses, visible, expected", [
    (["0"], None, TaskGpu(0, "0")),
    (["2"], None, TaskGpu(2, "2")),
    (["1"], "4,6", TaskGpu(1, "6")),                               # TorchDistributor: visible[address]
    (["0"], "GPU-8a1f,GPU-77c2", TaskGpu(0, "GPU-8a1f")),        # UUIDs in CUDA_VISIBLE_DEVICES
    (["2"], "0, 1, 5", TaskGpu(2, "5")),
])
def test_spark_addresses_count_the_gpus_the_executor_sees(addresses, visible, expected):
    assert task_gpu(addresses, visible) == expected


@pytest.mark.parametrize("addresses, visible, words", [
    (["3"], "4,6", r"address '3', but CUDA_VISIBLE_DEVICES='4,6' lists 2 GPU\(s\).*\(0 to 1\).*discoveryScript"),
    (["01"], None, r"address '01', which is not a GPU index"),
    (["gpu0"], "0", r"address 'gpu0', which is not a GPU index"),
])
def test_an_address_that_names_no_visible_gpu_is_a_clear_error(addresses, visible, words):
    with pytest.raises(InputDataError, match=words):
        task_gpu(addresses, visible)


def test_an_address_past_the_gpus_torch_sees_is_a_clear_error():
    with pytest.raises(InputDataError, match=r"address '2', but torch sees 2 CUDA device\(s\)"):
        choose_device(None, ["2"], 2, 0)


def test_a_task_given_several_gpus_uses_the_first_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="spark_torch_est.train.devices"):
        assert task_gpu(["1", "0"], None) == TaskGpu(1, "1")
    assert "gave this task 2 GPUs ['1', '0']; a rank uses one" in caplog.text


def test_use_gpu_without_cuda_is_a_clear_error():
    with pytest.raises(InputDataError, match="useGpu=True but torch sees no CUDA device.*\\['0'\\]"):
        choose_device(True, ["0"], 0, 0)


def test_gpus_spark_gave_a_task_without_cuda_run_on_the_cpu_and_say_so():
    device = choose_device(None, ["0"], 0, 0)
    assert device == torch.device("cpu")
    assert "Spark gave this task GPU(s) ['0'], but torch sees no CUDA device" in cpu_despite_gpus(device, ["0"], None)
    assert cpu_despite_gpus(device, [], None) is None and cpu_despite_gpus(device, ["0"], False) is None


def test_outside_a_spark_task_there_are_no_task_gpus():
    assert task_gpus() == ([], 0)


def test_state_leaves_the_device_with_its_containers_as_they_were():
    weight = torch.ones(2, requires_grad=True) * 2
    state = {"groups": [{"betas": (0.9, 0.99), "params": [0]}], "pair": (weight, [weight]), "step": 3}
    moved = to_cpu(state)
    assert moved["groups"] == state["groups"] and moved["step"] == 3
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert not moved["pair"][0].requires_grad and moved["pair"][0].device.type == "cpu"
