"""Sharded distillation with PyTorch FSDP2 (`fully_shard`), under `torchrun`.

`shard_distill_model` applies `fully_shard` to every unit of the model's `DistillStack`
(one per layer, plus the SwiftKV input unit) and then to the stack itself, over a 1-D mesh
of all processes (gloo on CPU, NCCL on CUDA). The frozen base is stored once, sharded: the
teacher and the student read the same modules. Each process keeps 1/N of every parameter,
gathers one unit at a time for its forward and backward, and reduce-scatters gradients.

Invariants:
- Gradients are SUMMED over processes (divide factor 1), like `DataParallel.sum_gradients`:
  each micro-batch loss is already divided by the step's global count of counted positions.
- Training states and exports hold full tensors in the unsharded layout (`full_tensor`),
  so a state written by a sharded run resumes a sharded or an unsharded one, and the
  export is the usual params-only checkpoint. Gathering is a collective: every process
  calls `trainable_state` / `full_optimizer_state`; only the main process writes.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from kvforge.tools.swiftkv.layer_units import DistillStack

MIXED_PRECISIONS = ("none", "bfloat16")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every process when sharded (a collective)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` (this process's shard when `like` is a DTensor)."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements)


def is_sharded(params: Any) -> bool:
    return any(isinstance(p, DTensor) for p in params)


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with every sharded state tensor gathered whole."""
    state = optimizer.state_dict()
    state["state"] = {index: {key: full_tensor(value) if isinstance(value, torch.Tensor) else value
                              for key, value in entry.items()}
                      for index, entry in state["state"].items()}
    return state


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a state written by `full_optimizer_state` (sharded run or not) into `optimizer`,
    each state tensor cut to its parameter's shard."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = dict(state)
    state["state"] = {index: {key: shard_like(value, params[int(index)]) if key != "step" and
                              isinstance(value, torch.Tensor) and value.dim() > 0 else value
                              for key, value in entry.items()}
                      for index, entry in state["state"].items()}
    optimizer.load_state_dict(state)


class WithStack(Protocol):
    """A model whose forward runs through a DistillStack (student.DistillModel)."""

    stack: DistillStack


def shard_distill_model(model: WithStack, device: torch.device, mixed_precision: str = "none") -> None:
    """Shard `model` in place over every process of the initialised process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISIONS}, got {mixed_precision!r}")
    if not dist.is_initialized():
        raise RuntimeError("shard_distill_model needs an initialised process group (torchrun, or "
                           "DataParallel.from_environment(..., fsdp=True))")
    # The SwiftKV input unit returns K/V as views of its projections' outputs; FSDP warns that an
    # in-place op on such a view would skip its backward hook. Nothing writes to them in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPSwiftKVInputUnit\) returned a view")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision == "bfloat16" else MixedPrecisionPolicy()
    stack = model.stack
    units = [*stack.units, stack.swiftkv_inputs]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(stack, mesh=mesh, mp_policy=policy)
    for module in (*units, stack):
        # A plain SUM (gloo has no pre-multiplied sum): the losses are normalised globally.
        module.set_force_sum_reduction_for_comms(True)
        module.set_gradient_divide_factor(1.0)
