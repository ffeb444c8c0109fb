"""Counts what would synchronise the host with a CUDA device, on CPU tensors.

There is no GPU here, so the decode paths run on CPU tensors (inside
`host_sync.device_code_paths()`, so they take their CUDA branches) under two modes that
record every operation that on CUDA makes the host wait for the device:

- `torch.Tensor` methods seen by a `TorchFunctionMode`: `tolist`, `numpy`, `cpu`, `.to`
  a CPU device without `non_blocking=True` (a blocking copy), and `torch.tensor` /
  `torch.as_tensor` of Python data with a `device=` (a blocking host-to-device copy);
- aten operations seen by a `TorchDispatchMode`: `_local_scalar_dense`, `is_nonzero`,
  `item` (what `bool(t)`, `t.item()`, `int(t)`, `float(t)` and `if t:` call), `nonzero`
  and one-argument `where` (also `argwhere`), `masked_select`, indexing or index_put with a boolean mask,
  `repeat_interleave` without `output_size`, `unique*`, `bincount`, `equal`.

Host tensors are not device memory: a tensor made by `torch.tensor(data)` without a
device, and any result computed from host tensors only, is tagged as host-side, and what
is done to it is not counted (a plan built on the host, the index list the host gathers
with). Everything else, model weights and cache storage included, stands for device
memory.

What it cannot see: copies between devices (every tensor is on the CPU, so `.to(device)`
of a host tensor is not distinguished from a no-op: code must go through
`step_plan.upload`, which is what would run on CUDA); CUDA-only calls that the CPU path
never makes (`torch.cuda.synchronize`, event and stream waits, pinned buffers); reads
inside C++ kernels (the compiled CPU kernels, which are not the CUDA path); host reads of
tensor memory through `data_ptr` or the buffer protocol.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvforge.host_sync import device_code_paths

_HOST = "_kvforge_host_tensor"
_TENSOR_READS = {"tolist", "numpy", "cpu"}
_ATEN_SYNCS = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "nonzero_numpy", "masked_select", "unique_dim", "_unique",
               "_unique2", "unique_consecutive", "unique_dim_consecutive", "bincount", "equal"}


@dataclass(frozen=True)
class Sync:
    region: str  # what the counter was told it is in, e.g. "layer 2 attend"
    op: str
    where: str  # innermost kvforge source line


def _is_host(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, _HOST, False)


def _where() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/src/kvforge/" in frame.filename:
            return f"{frame.filename.split('/src/')[-1]}:{frame.lineno}"
    return "?"


def _to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    targets = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
    return any(torch.device(t).type == "cpu" for t in targets) and not kwargs.get("non_blocking", False)


class SyncCounter:
    def __init__(self) -> None:
        self.syncs: list[Sync] = []
        self.region = "model"
        self._host_op = 0  # > 0 while a host-side operation runs (its aten ops are not counted)

    @contextmanager
    def within(self, region: str) -> Iterator[None]:
        previous, self.region = self.region, region
        try:
            yield
        finally:
            self.region = previous

    @contextmanager
    def counting(self, device_paths: bool = True) -> Iterator[SyncCounter]:
        """Count within the block, on the CUDA code paths (device_paths) or the CPU's own."""
        with device_code_paths() if device_paths else nullcontext(), _FunctionMode(self), _DispatchMode(self):
            yield self

    def record(self, op: str) -> None:
        self.syncs.append(Sync(self.region, op, _where()))

    def in_regions(self, prefix: str) -> list[Sync]:
        return [s for s in self.syncs if s.region.startswith(prefix)]


class _FunctionMode(TorchFunctionMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = bool(tensors) and all(_is_host(t) for t in tensors)
        made_on_host = name in ("tensor", "as_tensor") and not tensors and "device" not in kwargs
        if name in ("tensor", "as_tensor") and "device" in kwargs and not tensors:
            self.counter.record(f"torch.{name}(..., device=)")
        elif not host and (name in _TENSOR_READS or (name == "to" and _to_cpu(args, kwargs))):
            self.counter.record(f"Tensor.{name}")
        if host:
            self.counter._host_op += 1
        try:
            out = func(*args, **kwargs)
        finally:
            if host:
                self.counter._host_op -= 1
        if host or made_on_host:
            for result in tree_flatten(out)[0]:
                if isinstance(result, torch.Tensor):
                    setattr(result, _HOST, True)
        return out


class _DispatchMode(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.counter._host_op:
            name = func._schema.name.split("::")[-1]
            if name in _ATEN_SYNCS or name.startswith("unique") or (name == "where" and len(args) == 1):
                self.counter.record(name)
            elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
                    isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                    for i in (args[1] if len(args) > 1 else ())):
                self.counter.record(f"{name} with a boolean mask")
            elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) == 1 \
                    and kwargs.get("output_size") is None:
                self.counter.record("repeat_interleave without output_size")
        return func(*args, **kwargs)
