"""Chunk-page storage of compressed ShadowKV sequences: fast and slow tiers.

A *chunk page* holds one chunk (`chunk` consecutive tokens) of one sequence for every
global cache layer:
- fast tier: the landmark [H, D] of the chunk, per layer (its low-rank key coefficients
  live with the sequence's layer state, state.py: their rank differs per layer and
  sequence);
- slow tier: the chunk's values [H, chunk, D], per layer.
One page id indexes both tiers, so a sequence's compressed prefix is a list of page ids
(logical chunk j -> pages[j]) and a step's selection gathers rows of several sequences
with one index operation.

Tensors (P pages, Lg global cache layers):
  landmarks    [Lg, H, P, D]         fast (compute device), head-major: index_select over
                                     pages gives [H, ..]
  values       [Lg, H, P, chunk, D]  slow: a pageable CPU tensor ("memory"), a memory-mapped
               temporary file ("mmap", so values can exceed RAM) or a page-locked CPU
               tensor ("pinned")
All are allocated once with `torch.empty` (or a sparse file). On the CPU untouched pages cost
no memory; on CUDA the fast tensors cost their whole size, so their pages are the chunk share
of the budget split (split.py). With "memory" and "mmap" the slow tier is not pinned (pinning
locks all of it in RAM), and on CUDA a fetch gathers its values into a pinned staging buffer,
as large as the largest single fetch (the misses of one layer of one decode group), after the
host has learnt which pages to gather. With "pinned" on CUDA the whole tier is page-locked
once (`cudaHostRegister`, exactly its size: torch's pinned allocator would round it up to a
power of two), so kernels read it in place through its host address (unified addressing):
`values_in_place` says whether the compute device can read the slow tier so.
"""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import time
import weakref

import numpy as np
import torch

from kvforge.cache.block_pool import BlockPool

log = logging.getLogger(__name__)


def slow_tensor(shape: tuple[int, ...], dtype: torch.dtype, kind: str, directory: str | None = None) -> torch.Tensor:
    """Storage of the slow tier (always on the CPU, pageable)."""
    if kind == "mmap":
        element = torch.tensor([], dtype=dtype).element_size()
        numel = int(np.prod(shape))
        handle, path = tempfile.mkstemp(prefix="kvforge-shadowkv-", suffix=".values", dir=directory)
        os.close(handle)
        try:
            # A sparse file: blocks are written as pages are used. The mapping outlives the
            # name, so the file disappears with the process.
            raw = np.memmap(path, dtype=np.uint8, mode="w+", shape=(max(1, numel * element),))
        finally:
            os.unlink(path)
        return torch.from_numpy(raw)[:numel * element].view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype)


def register_pinned(tensor: torch.Tensor, device: torch.device) -> None:
    """Page-lock `tensor`'s memory for CUDA: device-readable at its host address."""
    # The kernels read the tier at its host address, which a device shares only where it can
    # use host pointers for registered memory (x86 with unified addressing; not every
    # platform): elsewhere every read would fault.
    in_place = reads_registered_memory_in_place(device)
    if in_place is False:
        raise RuntimeError(f"slow_store=pinned: {device} cannot read page-locked host memory at the CPU's address "
                           "(CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 0), which the kernels "
                           "need; use slow_store=memory")
    if in_place is None:
        log.warning("slow_store=pinned: the CUDA driver did not say whether %s reads page-locked host memory at the "
                    "CPU's address; assuming it does (as on x86 with unified addressing)", device)
    cudart = torch.cuda.cudart()
    size = tensor.numel() * tensor.element_size()
    status = cudart.cudaHostRegister(tensor.data_ptr(), size, 0)  # 0: default flags (mapped, portable)
    if int(status) != 0:  # (cudaGetErrorString takes the enum, not its value)
        raise RuntimeError(f"slow_store=pinned: cudaHostRegister of {size} bytes failed "
                           f"({cudart.cudaGetErrorString(status)}); lower slow_budget or use slow_store=memory")


# cuda.h: CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
_HOST_POINTER_FOR_REGISTERED_MEM = 91


def cuda_driver() -> ctypes.CDLL | None:
    """The CUDA driver library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def reads_registered_memory_in_place(device: torch.device) -> bool | None:
    """Whether CUDA `device` reads registered host memory at the CPU's virtual address (the
    driver's device attribute), or None when the driver cannot say."""
    driver = cuda_driver()
    if driver is None:
        return None
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    handle, value = ctypes.c_int(), ctypes.c_int()
    if driver.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(ordinal)) != 0:
        return None
    if driver.cuDeviceGetAttribute(ctypes.byref(value), ctypes.c_int(_HOST_POINTER_FOR_REGISTERED_MEM), handle) != 0:
        return None
    return value.value == 1


def unregister_pinned(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class ChunkStore:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, chunk: int, num_pages: int,
                 dtype: torch.dtype, device: torch.device, slow_kind: str, slow_dir: str | None) -> None:
        self.chunk = chunk
        self.device = device
        self.pool = BlockPool(num_pages)
        self.landmarks = torch.empty((num_layers, kv_heads, num_pages, head_dim), dtype=dtype, device=device)
        self.values = slow_tensor((num_layers, kv_heads, num_pages, chunk, head_dim), dtype,
                                  "memory" if slow_kind == "pinned" else slow_kind, slow_dir)
        self.values_in_place = device.type != "cuda" or slow_kind == "pinned"
        self.pinned_seconds: float | None = None  # how long page-locking the slow tier took (CUDA, pinned)
        if device.type == "cuda" and slow_kind == "pinned":
            start = time.perf_counter()
            register_pinned(self.values, device)
            self.pinned_seconds = time.perf_counter() - start
            # The finaliser holds the tensor until the store is collected, so the memory is
            # unregistered before it can be freed.
            weakref.finalize(self, unregister_pinned, self.values)
        self._staging: torch.Tensor | None = None  # pinned buffer of fetched values (CUDA)
        self._copied: torch.cuda.Event | None = None

    @property
    def num_pages(self) -> int:
        return self.pool.num_blocks

    def write(self, layer: int, pages: torch.Tensor, landmarks: torch.Tensor, values: torch.Tensor) -> None:
        """Store whole chunks: pages [C]; landmarks [H, C, D]; values [H, C, chunk, D]."""
        self.landmarks[layer].index_copy_(1, pages, landmarks.to(self.landmarks.dtype))
        self.values[layer].index_copy_(1, pages.cpu(), values.to("cpu", self.values.dtype))

    def gather_landmarks(self, layer: int, table: torch.Tensor, first_page: int | None = None) -> torch.Tensor:
        """table [B, C] page ids -> landmarks [H, B, C, D]. When the table is one run of
        consecutive pages from `first_page` (sequences compressed together), a view."""
        batch, chunks = table.shape
        per_layer = self.landmarks[layer]
        if first_page is not None:
            return per_layer[:, first_page:first_page + batch * chunks].view(per_layer.shape[0], batch, chunks, -1)
        return per_layer.index_select(1, table.reshape(-1)).view(per_layer.shape[0], batch, chunks, -1)

    def sequence_landmarks(self, layer: int, pages: torch.Tensor, run_start: int | None) -> torch.Tensor:
        """One sequence's landmarks [H, C, D]: a view when its pages are one run."""
        per_layer = self.landmarks[layer]
        if run_start is not None:
            return per_layer[:, run_start:run_start + pages.shape[0]]
        return per_layer.index_select(1, pages)

    def fetch_values(self, layer: int, heads: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Values of (head, page) pairs [M] -> [M, chunk, D] on the compute device."""
        per_layer = self.values[layer]
        flat = per_layer.view(-1, *per_layer.shape[2:])  # [H * P, chunk, D]
        index = (heads * per_layer.shape[1] + pages).cpu()
        if self.device.type != "cuda":
            return flat.index_select(0, index)
        # CUDA (not yet run on a GPU): gather on the CPU into a pinned staging buffer, then an
        # asynchronous copy on the caller's current stream (ShadowKV runs it on a side stream
        # while keys are rebuilt).
        count = int(index.numel())
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy out of the staging buffer is done
        if self._staging is None or self._staging.shape[0] < count:
            self._staging = torch.empty((max(count, 1), *flat.shape[1:]), dtype=flat.dtype, pin_memory=True)
        staging = self._staging[:count]
        torch.index_select(flat, 0, index, out=staging)
        fetched = staging.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return fetched
