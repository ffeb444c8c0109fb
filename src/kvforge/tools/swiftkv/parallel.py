"""Data parallelism for distillation: one process by default, several under `torchrun`.

Each process holds the whole (small) set of trainable parameters and a disjoint share of
every optimizer step's sequences. After the local micro-batches, the trainable gradients
are summed across processes in one flat all-reduce (gloo on CPU, NCCL on CUDA). Because
the loss of every micro-batch is already divided by the step's GLOBAL count of counted
positions (also all-reduced, before the first micro-batch), the summed gradient is exactly
the gradient of the global mean, and every process applies the same update.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DataParallel:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls, device: str = "cpu", group_of_one: bool = False) -> DataParallel:
        """Single process unless torchrun's WORLD_SIZE > 1; then joins (or reuses) the group.
        `group_of_one`: alone, still initialise a process group of one (FSDP needs a group)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            if group_of_one and not dist.is_initialized():
                backend = "nccl" if device.startswith("cuda") else "gloo"
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            return cls(0, 1, torch.device(device))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = device.startswith("cuda")
        if use_cuda:
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo")
        where = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
        return cls(dist.get_rank(), dist.get_world_size(), where)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over processes (no-op alone)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every parameter's .grad over processes in one flat buffer."""
        if self.world_size <= 1:
            return
        params = list(params)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            count = p.numel()
            p.grad.copy_(flat[offset:offset + count].view_as(p.grad))
            offset += count

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()
