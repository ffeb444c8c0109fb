"""ShadowKV's decode step for one global layer on CPU, as a C++ kernel compiled at first use.

`shadowkv_decode_cpu` fuses what `kvforge.cache.shadowkv.sparse.SparseAttention.attend`
does for a group of decode sequences (one query token each, the token already written
into its buffers): landmark scores and top-k per KV head, hit/miss against the reuse
slots, rebuild (coefficients x basis slice, then RoPE) and value fetch of the misses
straight into the slots, and attention over outliers + selected slots + exact window.
The PyTorch path stays the reference; the kernel's picks, slot ids and outputs equal its
(tests/cache/shadowkv/test_shadowkv_cpu_decode.py), up to float32 rounding and the order of exactly tied
scores. It exists because the PyTorch path issues dozens of small operations per layer and
sequence, whose overhead alone is a large part of a long-context decode step
(docs/benchmarks.md#measurements-behind-design-choices).

Work is split by (sequence, KV head) pair over torch's intra-op threads (each pair writes
only its own buffer rows, slot ids and output heads). Per pair the kernel also times its
phases, returned with the hit/miss counts.

Float32 only (other dtypes keep the PyTorch path). Built lazily by
`cpu_shadowkv_kernel_available()` through `kernels.build.CppKernel` (warn-once fallback;
`KVFORGE_DISABLE_CPU_KERNELS=1` disables it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.kernels.build import DISABLE_ENV, CppKernel

__all__ = ["DecodeCounters", "cpu_shadowkv_kernel_available", "shadowkv_decode_cpu"]

# torch.ops.kvforge_cpu_shadowkv.shadowkv_decode (TORCH_LIBRARY in the source).
_KERNEL = CppKernel(name="kvforge_cpu_shadowkv_decode", source=Path(__file__).with_name("cpu_decode.cpp"),
                    namespace="kvforge_cpu_shadowkv", op="shadowkv_decode", what="ShadowKV decode kernel",
                    fallback="the PyTorch ShadowKV decode path")


def cpu_shadowkv_kernel_available() -> bool:
    """True when the compiled kernel can be used (builds it on the first call)."""
    return _KERNEL.available()


@dataclass(frozen=True)
class DecodeCounters:
    """Summed over the call's (sequence, KV head) pairs; seconds are thread-seconds."""

    hits: int
    misses: int
    selection: float
    rebuild: float
    fetch: float
    attention: float


def shadowkv_decode_cpu(q: torch.Tensor, landmarks: torch.Tensor, slow_values: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, tables: list[torch.Tensor], candidates: list[torch.Tensor],
                        bases: list[torch.Tensor], coefficients: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor], slot_ids: list[torch.Tensor],
                        own_k: torch.Tensor | None, own_v: torch.Tensor | None, meta: torch.Tensor, scale: float,
                        reuse: bool) -> tuple[torch.Tensor, DecodeCounters]:
    """One layer's decode attention of B sequences; returns (out [B, heads, D], counters).

    q [B, heads, D] (RoPE applied); landmarks [H, P, D] and slow_values [H, P, chunk, D]
    are the layer's views of the chunk store; cos/sin [N, D] RoPE tables of positions
    0..N-1. Per sequence: page table [C], candidate mask [H, C], basis [r, H x D] and the
    chunks' coefficients [>= C, chunk, r] (r its own), K/V buffers [H, R, D] and slot ids
    [H, k] (the last three updated in place); own_k/own_v [B, H, D]: the step's token, written into the last row in use
    first (None: already there); meta [B, 3] = (slots_start, window_start, rows in use).
    Everything float32 (int64 / bool for indices and masks) and contiguous; raises
    RuntimeError when the kernel is unavailable (check `cpu_shadowkv_kernel_available()`)."""
    if not cpu_shadowkv_kernel_available():
        raise RuntimeError(f"the CPU ShadowKV decode kernel is not available (build failed or {DISABLE_ENV} is set)")
    out, counters = torch.ops.kvforge_cpu_shadowkv.shadowkv_decode(
        q, landmarks, slow_values, cos, sin, tables, candidates, bases, coefficients, keys, values, slot_ids,
        _empty_if_none(own_k, q), _empty_if_none(own_v, q), meta, float(scale), bool(reuse))
    totals = counters.sum(dim=0).tolist()
    return out, DecodeCounters(int(totals[0]), int(totals[1]), *totals[2:])


def _empty_if_none(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t.contiguous()
