"""Host synchronisations of the decode path: where one may happen, and the one ShadowKV needs.

On CUDA, reading a device value on the host (`bool(t)`, `t.item()`, `t.tolist()`,
`t.cpu()`, `nonzero`, boolean-mask indexing, a blocking copy of Python data to the device)
waits for every kernel queued before it, so the GPU runs dry once per such read. The decode
path of every cache method therefore reads nothing from the device inside the layer loop,
with two named exceptions:

- data-dependent early-outs (skip a tile no sequence sees) are taken only where the read
  is free, on host memory (`host_memory(device)`: the CPU); elsewhere a masked computation
  that gives the same result replaces them;
- ShadowKV fetches the values of missed chunks from its slow tier, which is host memory:
  the host has to know which pages to gather. That is one device-to-host copy of a
  fixed-size index tensor per global layer (`HostCopy`), queued behind the selection and
  waited for only when the host needs it. With `slow_store=pinned` on CUDA a Triton kernel
  reads the values in place instead, and ShadowKV's decode step reads nothing either.

Per-step plans (page tables, rows, slots) are built on the host before the layer loop and
reach the device in one non-blocking copy (`step_plan.upload`; nothing to copy to the CPU).

`device_code_paths()` makes `host_memory` False for the CPU too, so tests run the CUDA code
paths (plan copies included) on CPU tensors and count what would synchronise there
(tests/cache/test_host_sync.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_device_paths = False


def host_memory(device: torch.device) -> bool:
    """Whether tensors on `device` live in host memory (the CPU): reading their values
    costs nothing, so code may branch on them, and host tensors need no copy to it."""
    return device.type == "cpu" and not _device_paths


@contextmanager
def device_code_paths() -> Iterator[None]:
    """Within the block, CPU tensors take the code paths CUDA tensors take (no early-outs)."""
    global _device_paths
    previous, _device_paths = _device_paths, True
    try:
        yield
    finally:
        _device_paths = previous


class HostCopy:
    """An integer device tensor on its way to the host. On CUDA the copy into pinned memory
    is queued without waiting, and `tolist` waits for that copy alone (an event), so work
    queued after it keeps the GPU busy while the host waits; on the CPU it is the tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
