"""Batched paged decode attention on CPU, as a C++ kernel compiled at first use.

`paged_decode_attention_cpu` has exactly the semantics of
`kvforge.cache.attention.decode_attention` (without `tile_pages`), but reads every visible
K/V row once, in place, from the paged storage: no gather copy, no bmm temporaries. Work
is split over (sequence, kv head) pairs, and long pairs into slices whose partial softmax
states are merged, with `at::parallel_for` (so `torch.set_num_threads` applies). The
`heads // kv_heads` queries of a group are processed together, so each loaded row serves
all of them.

bf16 queries over bf16 pages take a bf16 dot-product path where the CPU has AVX512-BF16
(head dims 64, 128, 256): vdpbf16ps for q.k and for P V, float32 softmax, weights rounded
to bf16 once (the precision of ATen's bf16 flash attention; cpu_bf16_attention.h). It
needs about half the instructions per row of the widening float path, which pays on
scattered pages and not on ascending ones, where the kernel waits on memory
(docs/benchmarks.md#measurements-behind-design-choices). The float path
stays the reference: `bf16_dot(False)` turns the dot path off for the process.

The kernel is built lazily by `cpu_kernels_available()` with
`torch.utils.cpp_extension.load` (needs a C++ compiler and `ninja`). Success or failure is
cached for the process; a failure is logged once as a warning and callers fall back to the
PyTorch path. `KVFORGE_DISABLE_CPU_KERNELS=1` forces the fallback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kvforge.kernels.build import DISABLE_ENV, FLOAT_IO_DTYPES, CppKernel

__all__ = ["DISABLE_ENV", "bf16_dot", "bf16_dot_supported", "cpu_kernels_available", "paged_decode_attention_cpu"]

# torch.ops.kvforge_cpu.paged_decode_attention (TORCH_LIBRARY in the source). The build
# (flag fallbacks, fingerprinted build directory, lazy lock, warning) is `build.CppKernel`.
_KERNEL = CppKernel(name="kvforge_cpu_paged_attention", source=Path(__file__).with_name("cpu_decode.cpp"),
                    namespace="kvforge_cpu", op="paged_decode_attention", what="paged attention kernel",
                    fallback="the PyTorch decode attention")
SOURCE = _KERNEL.source


def cpu_kernels_available() -> bool:
    """True when the compiled kernel can be used (builds it on the first call)."""
    return _KERNEL.available()


def bf16_dot_supported() -> bool:
    """True when the built kernel has the bf16 dot path (AVX512-BF16 at build time)."""
    return cpu_kernels_available() and bool(torch.ops.kvforge_cpu.bf16_dot_supported())


@contextmanager
def bf16_dot(enabled: bool) -> Iterator[None]:
    """Within the block, bf16-over-bf16 decode attention takes the bf16 dot path (True, the
    default) or the widening float path (False); process-wide, restored on exit."""
    if not cpu_kernels_available():
        raise RuntimeError("the CPU paged attention kernel is not available")
    previous = torch.ops.kvforge_cpu.set_bf16_dot(enabled)
    try:
        yield
    finally:
        torch.ops.kvforge_cpu.set_bf16_dot(previous)


def paged_decode_attention_cpu(q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor,
                               k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                               first_page_position: torch.Tensor, visible_from: torch.Tensor,
                               visible_to: torch.Tensor, scale: float, k_scales: torch.Tensor | None = None,
                               v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its own new key plus stored keys, accumulated in float32.

    Shapes and meaning as `decode_attention`: q [B, heads, D]; k_self/v_self [B, kv_heads, D];
    k_pages/v_pages [kv_heads, num_pages, block, D] (float32/bfloat16/float16, or float8
    with k_scales/v_scales [kv_heads, num_pages, block] float32, one per row: cache/full/fp8.py;
    any strides with unit stride along D, e.g. the view `store[layer]`); page_table [B, P] int64; the
    token in column j of row b has position first_page_position[b] + j and is visible iff
    visible_from[b] <= position < visible_to[b]. Returns [B, heads, D] in q's dtype.
    Raises RuntimeError when the kernel is unavailable; check `cpu_kernels_available()`.
    """
    if not cpu_kernels_available():
        raise RuntimeError("the CPU paged attention kernel is not available "
                           f"(build failed or {DISABLE_ENV} is set)")
    if not (q.is_cpu and k_pages.is_cpu and v_pages.is_cpu):  # the C++ side checks the rest
        raise ValueError("paged_decode_attention_cpu takes CPU tensors only")
    # Only the small per-step tensors are normalised here (copies of O(B * heads * D)), and
    # only when needed: this runs once per layer and decode step, so its overhead counts.
    # The page storage is passed as is. Storage without unit stride along D would have to
    # be copied whole, which defeats the kernel; no cache in kvforge produces one.
    if k_pages.stride(-1) != 1:
        k_pages = k_pages.contiguous()
    if v_pages.stride(-1) != 1:
        v_pages = v_pages.contiguous()
    # bf16/f16 queries are widened inside the kernel and the output comes back in their dtype.
    io = q.dtype if q.dtype in FLOAT_IO_DTYPES else torch.float32
    out = torch.ops.kvforge_cpu.paged_decode_attention(
        _as(q, io), _as(k_self, io), _as(v_self, io), k_pages, v_pages,
        _as(page_table, torch.int64), _as(first_page_position, torch.int64), _as(visible_from, torch.int64),
        _as(visible_to, torch.int64), float(scale), _NO_SCALES if k_scales is None else k_scales,
        _NO_SCALES if v_scales is None else v_scales)
    return out if out.dtype == q.dtype else out.to(q.dtype)


_NO_SCALES = torch.empty(0)  # 16/32-bit pages: no scales (the kernel reads none)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()
