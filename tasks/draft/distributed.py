"""The training process's place among its peers: one process, or a rank under torchrun (DDP;
gloo on CPU, nccl on GPU), where only rank 0 writes and every rank sums its figures with the
others'."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def current(cls) -> Dist:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
        return cls()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor

    def device(self, configured: str) -> torch.device:
        """train.device for this process: under DDP on CUDA, the rank's own GPU."""
        device = torch.device(configured)
        if device.type == "cuda" and self.world > 1:
            return torch.device("cuda", self.local_rank)
        return device
