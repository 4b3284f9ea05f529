"""[executor] Batches copied to the GPU one step ahead: the copy of the next batch runs on
a side stream, from pinned memory, while the current step computes.

On the CPU there is nothing to copy: :func:`prefetch` hands the batches on as they come,
taking each from its source only when the loop asks for it. On CUDA, :class:`CudaTransfer`
does the copies; the order of its calls is :func:`prefetch`'s business, so the overlap
logic is tested with a recording transfer on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import torch

__all__ = ["Transfer", "CudaTransfer", "prefetch", "transfer_for", "map_tensors"]

B = TypeVar("B")


class Transfer(Protocol):
    """Moves a batch (a tensor, None, or lists and tuples of them) to a device in two halves."""

    def start(self, batch: Any) -> Any:
        """Issues the batch's copies without waiting for them; returns the batch to be."""

    def finish(self, started: Any) -> Any:
        """Makes the copies of a started batch visible to the work issued from now on; returns it."""


class CudaTransfer:
    """:class:`Transfer` to one GPU on its own stream, from pinned memory, ``non_blocking``.

    Args:
        device: The CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def start(self, batch: Any) -> Any:
        with torch.cuda.stream(self.stream):
            return map_tensors(lambda x: x.pin_memory().to(self.device, non_blocking=True), batch)

    def finish(self, started: Any) -> Any:
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)  # the copies issued so far: not the next batch's, issued after this

        def owned(x: torch.Tensor) -> torch.Tensor:
            x.record_stream(current)  # made on the side stream, used on this one: not freed under it
            return x

        return map_tensors(owned, started)


def transfer_for(device: torch.device) -> Transfer | None:
    """The transfer a rank on ``device`` uses: :class:`CudaTransfer` on a GPU, None on the CPU."""
    return CudaTransfer(device) if device.type == "cuda" else None


def prefetch(batches: Iterable[B], transfer: Transfer | None) -> Iterator[B]:
    """Yields ``batches`` on the transfer's device, the copy of each next batch started
    before the current one is handed out, so it overlaps the caller's work on it.

    Args:
        batches: Batches on the CPU.
        transfer: How to move them; None hands them on unchanged, one at a time.
    """
    if transfer is None:
        yield from batches
        return
    source = iter(batches)
    following = next(source, None)
    started = transfer.start(following) if following is not None else None
    while started is not None:
        ready = transfer.finish(started)
        following = next(source, None)
        started = transfer.start(following) if following is not None else None
        yield ready


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (lists and tuples are rebuilt)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(fn, item) for item in value)
    return value
