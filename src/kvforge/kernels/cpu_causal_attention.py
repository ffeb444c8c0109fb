"""Causal prefill attention on the CPU for bf16 and float32, a C++ kernel built at first use.

A prompt's attention is a large part of a prefill, and ATen's CPU flash attention runs at
about half the float32 FMA rate and is no faster for bf16 than for float32
(docs/benchmarks.md#measurements-behind-design-choices). This kernel does the same flash
attention with AVX-512 dot products: AVX512-BF16 `vdpbf16ps` (bf16 pairs into float32) for
bf16, float32 FMAs for float32, for both the score and the value products; it reads
grouped-query K/V without copying them per query head, and returns the log-sum-exp beside the
output for merging partial attentions (see cpu_causal_attention.cpp for the exact arithmetic:
for bf16 the precision of ATen's bf16 path, float32 softmax with bf16 weights; for float32 all
in float32).

`causal_attention` returns None when the call is not eligible: neither bf16 nor float32 (or
mixed), another device, autograd needed, a head dim that is not a multiple of 64, a CPU
without the dtype's instructions (AVX512-BF16 for bf16, AVX-512F for float32), or the kernel
unavailable or disabled by `KVFORGE_DISABLE_CPU_KERNELS=1`. Callers then run ATen's
scaled-dot-product attention, which stays the reference (tests compare both with a float64
definition in tests/kernels/test_cpu_causal_attention.py and
test_cpu_causal_attention_float32.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvforge.kernels.build import CppKernel, kernels_disabled

__all__ = ["causal_attention", "causal_attention_available", "causal_attention_runs"]

_KERNEL = CppKernel(name="kvforge_cpu_causal", source=Path(__file__).with_name("cpu_causal_attention.cpp"),
                    namespace="kvforge_cpu_causal", op="causal_attention",
                    what="causal attention kernel", fallback="ATen's attention")

HEAD_DIM_MULTIPLE = 64  # the value micro-kernel covers 64 dims at a time


def causal_attention_runs() -> bool:
    """True when the kernel is built and this CPU runs it for either dtype (what `kvforge
    bench` and `make setup` report after building it)."""
    return causal_attention_available(torch.bfloat16) or causal_attention_available(torch.float32)


def causal_attention_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when the kernel is built and this CPU runs it for `dtype` (bf16: AVX512-BF16;
    float32: AVX-512F; any other dtype: False)."""
    if dtype not in (torch.bfloat16, torch.float32) or kernels_disabled() or not _KERNEL.available():
        return False
    ops = torch.ops.kvforge_cpu_causal
    return bool(ops.supported() if dtype == torch.bfloat16 else ops.supported_float32())


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Queries q [n, heads, D] at key positions m - n .. m - 1 over head-major k/v
    [kv_heads, m, D], each query seeing the keys at or before its position.

    Returns (out [n, heads, D] in q's dtype, lse [heads, n] float32) or None (not eligible)."""
    dtype = q.dtype
    if dtype not in (torch.bfloat16, torch.float32) or not all(
            t.dtype == dtype and t.is_cpu and t.dim() == 3 for t in (q, k, v)):
        return None
    n, heads, dim = q.shape
    kv_heads, m = k.shape[0], k.shape[1]
    if (v.shape != k.shape or k.shape[2] != dim or dim % HEAD_DIM_MULTIPLE or heads % kv_heads
            or not 1 <= n <= m):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return None
    if not causal_attention_available(dtype):
        return None
    # The kernel reads bf16 q and k as 32-bit pairs: their rows must start on even elements.
    pairs = dtype == torch.bfloat16
    if q.stride(2) != 1 or (pairs and (q.stride(0) % 2 or q.stride(1) % 2 or q.data_ptr() % 4)):
        q = q.contiguous()
    if k.stride(2) != 1 or (pairs and (k.stride(0) % 2 or k.stride(1) % 2 or k.data_ptr() % 4)):
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    return torch.ops.kvforge_cpu_causal.causal_attention(q, k, v, float(scale))
