"""Which rank a training process is: the identity for one process (`Ranks`), a rank of the default process
group (`DistRanks`, DDP; FSDP subclasses it). The training loop shards batches and reduces sums through it."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Ranks:
    """Single-process rank: the identity for sharding and reductions. DistRanks below is a rank of a process group."""

    rank, world = 0, 1
    collective_forward = False  # True where every forward is a collective (FSDP): validation goes through it

    def shard(self, x: torch.Tensor, even: bool = True) -> torch.Tensor:
        """This rank's rows of a global batch (`even`: every rank must get the same number)."""
        return x

    def val_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's validation windows and which of them are real (None: all); workers.training.fsdp pads."""
        return self.shard(x, even=False), None

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def no_sync(self, module: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Skip gradient synchronisation on accumulation micro-batches (DDP)."""
        return contextlib.nullcontext()


class DistRanks(Ranks):
    """This process's rank in the default process group."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def shard(self, x: torch.Tensor, even: bool = True) -> torch.Tensor:
        n = x.shape[0]
        if even and n % self.world:
            raise ValueError(
                f"DistillSpec.batch_size: {n} is not allowed with {self.world} ranks; "
                f"allowed: a multiple of {self.world}"
            )
        per = -(-n // self.world)
        return x[self.rank * per : (self.rank + 1) * per]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        y = x.detach().clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        return y

    def no_sync(self, module: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return (
            contextlib.nullcontext()
            if last or not isinstance(module, DistributedDataParallel)
            else module.no_sync()
        )
