"""[executor] Which device a task uses: the GPU Spark gave it, else the CPU.

Spark hands a task the addresses of its GPUs (``spark.task.resource.gpu.amount``, found by
``spark.executor.resource.gpu.discoveryScript``). They count the GPUs the executor sees:
with ``CUDA_VISIBLE_DEVICES`` set, address ``i`` is the ``i``-th GPU of that list, as
``TorchDistributor`` reads them, and torch in this process numbers that GPU ``i`` too.
One task is one rank on one GPU. State that leaves the device (checkpoints, metric
states) goes through :func:`to_cpu`.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from spark_torch_est.errors import InputDataError

__all__ = ["TaskGpu", "task_gpu", "choose_device", "task_device", "task_gpus", "cpu_despite_gpus", "to_cpu"]

logger = logging.getLogger(__name__)

_ADDRESS = re.compile(r"^(0|[1-9][0-9]*)$")  # what CUDA_VISIBLE_DEVICES takes (TorchDistributor's check)


@dataclass(frozen=True)
class TaskGpu:
    """The GPU of one task.

    Attributes:
        index: Its CUDA index in this process (``cuda:<index>``).
        physical: What ``CUDA_VISIBLE_DEVICES`` calls it (its entry there), or the address
            when the variable is not set.
    """

    index: int
    physical: str


def task_gpu(addresses: list[str], visible: str | None) -> TaskGpu:
    """Maps the GPU address Spark gave a task through ``CUDA_VISIBLE_DEVICES``.

    Args:
        addresses: The task's GPU addresses (``resources()["gpu"].addresses``), at least one.
        visible: The executor's ``CUDA_VISIBLE_DEVICES``, or None when it is not set.

    Raises:
        InputDataError: An address that is not a GPU index, or one past the GPUs
            ``CUDA_VISIBLE_DEVICES`` lists.
    """
    if len(addresses) > 1:
        logger.warning("Spark gave this task %d GPUs %s; a rank uses one, the first (set "
                       "spark.task.resource.gpu.amount=1)", len(addresses), addresses)
    address = addresses[0]
    if not _ADDRESS.match(address):
        raise InputDataError(f"Spark gave the task GPU address {address!r}, which is not a GPU index (0, 1, ...); "
                             "fix spark.executor.resource.gpu.discoveryScript")
    index = int(address)
    if visible is None:
        return TaskGpu(index, address)
    listed = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if index >= len(listed):
        raise InputDataError(
            f"Spark gave the task GPU address {address!r}, but CUDA_VISIBLE_DEVICES={visible!r} lists {len(listed)} "
            f"GPU(s): Spark's addresses count the GPUs the executor sees (0 to {len(listed) - 1}), as TorchDistributor "
            "reads them; make spark.executor.resource.gpu.discoveryScript report those")
    return TaskGpu(index, listed[index])


def choose_device(use_gpu: bool | None, gpus: list[str], cuda_devices: int, rank: int,
                  visible: str | None = None) -> torch.device:
    """The device of one task: the GPU Spark gave it (see :func:`task_gpu`), else one
    picked by rank (or partition) when Spark gives none, else the CPU.

    Args:
        use_gpu: The ``useGpu`` Param: True, False or None (a GPU when there is one).
        gpus: GPU addresses Spark gave the task.
        cuda_devices: ``torch.cuda.device_count()`` on the executor.
        rank: This rank (a partition's index outside training).
        visible: The executor's ``CUDA_VISIBLE_DEVICES``, or None.

    Raises:
        InputDataError: ``useGpu=True`` on an executor where torch sees no GPU, or an
            address :func:`task_gpu` cannot map.
    """
    if use_gpu is False:
        return torch.device("cpu")
    if cuda_devices == 0:
        if use_gpu:
            raise InputDataError(
                f"useGpu=True but torch sees no CUDA device on this executor (Spark assigned GPUs {gpus or 'none'}); "
                "install a CUDA build of torch there or set useGpu=False")
        return torch.device("cpu")
    if not gpus:
        return torch.device("cuda", rank % cuda_devices)
    gpu = task_gpu(gpus, visible)
    if gpu.index >= cuda_devices:
        raise InputDataError(f"Spark gave the task GPU address {gpus[0]!r}, but torch sees {cuda_devices} CUDA "
                             "device(s) on this executor; fix spark.executor.resource.gpu.discoveryScript")
    logger.info("on GPU %s (Spark's address %s, cuda:%d)", gpu.physical, gpus[0], gpu.index)
    return torch.device("cuda", gpu.index)


def cpu_despite_gpus(device: torch.device, gpus: list[str], use_gpu: bool | None) -> str | None:
    """What to tell the user when a task Spark gave GPUs runs on the CPU because torch sees
    no CUDA device; None otherwise."""
    if device.type != "cpu" or not gpus or use_gpu is False:
        return None
    return (f"Spark gave this task GPU(s) {gpus}, but torch sees no CUDA device (a CPU build of torch?): "
            "running on the CPU")


def task_device(use_gpu: bool | None, gpus: list[str], rank: int) -> torch.device:
    """:func:`choose_device` in this process: the CUDA devices torch sees here and the
    executor's ``CUDA_VISIBLE_DEVICES``."""
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return choose_device(use_gpu, gpus, cuda_devices, rank, os.environ.get("CUDA_VISIBLE_DEVICES"))


def task_gpus() -> tuple[list[str], int]:
    """The GPU addresses Spark gave the running task and its partition index (``[]`` and
    0 outside a Spark task)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        return [], 0
    resource = context.resources().get("gpu")
    return (list(resource.addresses) if resource is not None else []), context.partitionId()


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it detached and on the CPU, in dicts, lists and
    tuples as they are (a tuple stays a tuple); anything else is returned as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(to_cpu(v) for v in value)
    return value
