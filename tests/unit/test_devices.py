"""Rank-to-device mapping, without GPUs (Spark's task resources are plain strings)."""

import pytest
import torch

from spark_torch_est.data import InputDataError
from spark_torch_est.worker import choose_device


@pytest.mark.parametrize("use_gpu, gpus, cuda, rank, expected", [
    (None, [], 0, 0, "cpu"),                 # auto on a CPU executor
    (None, ["0"], 0, 1, "cpu"),              # Spark has GPU resources, torch has no CUDA build
    (False, ["1"], 2, 0, "cpu"),             # switched off
    (None, ["1"], 2, 0, "cuda:1"),           # the GPU Spark assigned this task
    (True, ["3"], 4, 1, "cuda:3"),
    (True, [], 2, 3, "cuda:1"),              # no task resources: one GPU per rank, round robin
])
def test_each_rank_takes_the_gpu_spark_assigned(use_gpu, gpus, cuda, rank, expected):
    assert choose_device(use_gpu, gpus, cuda, rank) == torch.device(expected)


def test_use_gpu_without_cuda_is_a_clear_error():
    with pytest.raises(InputDataError, match="useGpu=True but torch sees no CUDA device.*\\['0'\\]"):
        choose_device(True, ["0"], 0, 0)
