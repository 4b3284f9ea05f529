"""[executor] This rank among the fit's ranks: the tensor collectives of the loop.

Every rank runs the same collectives in the same order. They move tensors only, on the
rank's device: nothing a peer sends is unpickled, and a peer's RNG state is checked value
by value before it is kept (see :mod:`spark_torch_est.core.rng`). With one rank there is nothing
to exchange, so each collective hands back its own value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spark_torch_est.core import rng

__all__ = ["Ranks"]


class Ranks:
    """This rank and its peers.

    Args:
        rank: This rank.
        world_size: Number of ranks.
        device: Where this rank's tensors live (collectives run there).
    """

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """``tensor`` combined over every rank (by ``op``), on the CPU."""
        if self.world_size == 1:
            return tensor
        on_device = tensor.to(self.device)
        dist.all_reduce(on_device, op=op)
        return on_device.cpu()

    def rng_states(self) -> list[torch.Tensor]:
        """Every rank's RNG state, in rank order, gathered as tensors and checked.

        Raises:
            ValueError: A peer sent a malformed state.
        """
        state = rng.capture(self.device)
        if self.world_size == 1:
            return [state]
        lengths = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(lengths, torch.tensor([len(state)], device=self.device))
        longest = int(max(int(n) for n in lengths))
        padded = torch.zeros(longest, dtype=torch.float64, device=self.device)
        padded[:len(state)] = state.to(self.device)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        states = [g[:int(n)].cpu() for g, n in zip(gathered, lengths)]
        for peer, peer_state in enumerate(states):
            try:
                rng.check(peer_state)
            except ValueError as error:
                raise ValueError(f"rank {peer} sent a malformed RNG state: {error}") from None
        return states

    def counts(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local`` int64 counts, one row per rank (``(world, *local.shape)``)."""
        gathered = torch.zeros(self.world_size, *local.shape, dtype=torch.int64)
        gathered[self.rank] = local
        return self.all_reduce(gathered)

    def exchange(self, values: torch.Tensor, sent: list[int], received: list[int]) -> torch.Tensor:
        """All to all: the first ``sent[0]`` rows of ``values`` go to rank 0, the next
        ``sent[1]`` to rank 1, ...; returns the ``received[r]`` rows each rank ``r`` sent
        here, in rank order, on the CPU."""
        if self.world_size == 1:
            return values
        out = torch.empty((sum(received), *values.shape[1:]), dtype=values.dtype, device=self.device)
        dist.all_to_all_single(out, values.contiguous().to(self.device), received, sent)
        return out.cpu()
