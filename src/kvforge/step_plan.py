"""Per-step plan tensors: built on the host, sent to the compute device in one copy.

A cache method plans each step on the host before the layer loop (page tables, rows,
slots, lengths: small integer tensors). Built one by one with `torch.tensor(..., device=
cuda)`, each would be a blocking copy, a synchronisation per tensor. Instead the plan is
built with CPU tensors and `upload` moves all of them at once: packed into one host
buffer per dtype (pinned on CUDA), one non-blocking copy each, and views of the device
buffer put back where the CPU tensors were. On the CPU the plan is returned as it is
(except under `host_sync.device_code_paths()`, where tests count what CUDA would do).

`upload` walks dataclass instances (frozen or not), tuples, lists and dicts; it does not
descend into anything else, and leaves tensors already on another device alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvforge.host_sync import host_memory

T = TypeVar("T")


def upload(plan: T, device: torch.device) -> T:
    """`plan` with every CPU tensor in it replaced by the same values on `device`."""
    if host_memory(device):
        return plan
    found: list[torch.Tensor] = []
    _walk(plan, lambda t: found.append(t) or t)
    moved = dict(zip(map(id, found), pack(found, device)))
    return _walk(plan, lambda t: moved[id(t)])


def pack(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The tensors (CPU) on `device`: one host buffer and one non-blocking copy per dtype;
    each result is a view of its dtype's device buffer."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        sizes = [tensors[i].numel() for i in members]
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
        if members:
            torch.cat([tensors[i].reshape(-1) for i in members], out=host)
        # From pinned memory the copy is asynchronous; the caching host allocator keeps the
        # buffer until the copy is done, so it can be dropped right away.
        on_device = host.to(device, non_blocking=True)
        for i, part in zip(members, on_device.split(sizes)):
            out[i] = part.view(tensors[i].shape)
    return out  # type: ignore[return-value]


def _walk(node: Any, replace: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        return replace(node) if node.device.type == "cpu" else node
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {f.name: _walk(getattr(node, f.name), replace) for f in dataclasses.fields(node) if f.init}
        return dataclasses.replace(node, **changes)
    if isinstance(node, (tuple, list)):
        return type(node)(_walk(item, replace) for item in node)
    if isinstance(node, dict):
        return {key: _walk(value, replace) for key, value in node.items()}
    return node
