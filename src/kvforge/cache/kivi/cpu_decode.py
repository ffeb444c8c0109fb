"""KIVI decode attention on CPU, as a C++ kernel compiled at first use.

`kivi_decode_attention_cpu` has exactly the semantics of
`kvforge.cache.kivi.attention.kivi_decode_attention` (without `tile_pages`) but reads the
quantised pages in place and never dequantises a tile into memory. Codes are unpacked in
vector registers (shift + 16-entry table lookup on AVX-512, shift + mask + convert
elsewhere) and each unpacked vector feeds the FMAs of every query head of the kv group:
keys with the pre-scaling algebra of the layout (/work/notes/kivi_layout.md),
q . k_hat(t) = sum_c q_c zero_c + sum_c (q_c scale_c) code(t, c), q scaled once per page
and the page's scores held in registers across its channels; values dequantised in
registers (the lookup table holds code * scale + zero) into a [heads, D] accumulator held
in registers across the page's tokens. The next tile's scattered pages and ring rows are
prefetched while a tile runs. Work units are page slices of (sequence, kv head) pairs,
taken dynamically by the threads and merged by log-sum-exp (split-K), so a small batch of
long sequences still uses every thread; float32 accumulation, online softmax per tile.

Reading codes instead of 16-bit rows, it takes less time per (token, kv head) than the
fp16 full-precision paged kernel, at 2 and at 4 bits (`benchmarks/kivi_kernel_micro.py`;
docs/benchmarks.md#measurements-behind-design-choices).

Built lazily by `cpu_kivi_kernel_available()` through `kernels.build.CppKernel` (warn-once
fallback to the PyTorch path; `KVFORGE_DISABLE_CPU_KERNELS=1` disables it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvforge.cache.kivi.store import KIVILayerView
from kvforge.kernels.build import DISABLE_ENV, CppKernel

__all__ = ["cpu_kivi_kernel_available", "kivi_decode_attention_cpu"]

KEY_DOT_CODES = {"float": 0, "int8": 1}  # the kernel's `key_dot` argument
VALUE_DOT_CODES = {"float": 0, "int8": 1}  # the kernel's `value_dot` argument

# torch.ops.kvforge_cpu_kivi.kivi_decode_attention (TORCH_LIBRARY in the source).
_KERNEL = CppKernel(name="kvforge_cpu_kivi_attention", source=Path(__file__).with_name("cpu_decode.cpp"),
                    namespace="kvforge_cpu_kivi", op="kivi_decode_attention", what="KIVI attention kernel",
                    fallback="the PyTorch KIVI decode attention")


def cpu_kivi_kernel_available() -> bool:
    """True when the compiled kernel can be used (builds it on the first call)."""
    return _KERNEL.available()


def kivi_decode_attention_cpu(q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor, view: KIVILayerView,
                              page_table: torch.Tensor, first_page_position: torch.Tensor,
                              visible_from: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                              scale: float, rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                              key_dot: str = "float", value_dot: str = "float") -> torch.Tensor:
    """Arguments as `kivi_decode_attention`; returns [B, heads, D] in q's dtype.
    rope_tables: with pre-RoPE stored keys, `StoredKeys.rope_tables` (cos, sin [D/2, T]).
    key_dot: "float" or "int8" (`kivi:key_dot`, the definition in int8_keys.py); value_dot
    likewise (`kivi:value_dot`, int8_values.py).
    Raises RuntimeError when the kernel is unavailable; check `cpu_kivi_kernel_available()`."""
    if not cpu_kivi_kernel_available():
        raise RuntimeError(f"the CPU KIVI attention kernel is not available (build failed or {DISABLE_ENV} is set)")
    tensors = (q, view.k_codes, view.v_codes, view.k_res, view.v_res)
    if not all(t.is_cpu for t in tensors):
        raise ValueError("kivi_decode_attention_cpu takes CPU tensors only")
    # The store views are contiguous already (`.contiguous()` is then free); only the small
    # per-step tensors may need a conversion.
    # q, k_self, v_self of one 16/32-bit float dtype go as they are (the op widens them and
    # returns q's dtype, rounded as Tensor.to rounds); anything else is widened to float32.
    io = q.dtype if q.dtype in _IO_DTYPES and k_self.dtype == v_self.dtype == q.dtype else torch.float32
    out = torch.ops.kvforge_cpu_kivi.kivi_decode_attention(
        _as(q, io), _as(k_self, io), _as(v_self, io),
        view.k_codes.contiguous(), view.k_scale.contiguous(), view.k_zero.contiguous(),
        view.v_codes.contiguous(), view.v_scale.contiguous(), view.v_zero.contiguous(),
        view.k_res.contiguous(), view.v_res.contiguous(), _as(page_table, torch.int64),
        _as(first_page_position, torch.int64), _as(visible_from, torch.int64), _as(lengths, torch.int64),
        _as(slots, torch.int64), float(scale), int(view.bits), view.k_sink, view.v_sink, int(view.vbits),
        *(rope_tables or (None, None)), KEY_DOT_CODES[key_dot], VALUE_DOT_CODES[value_dot])
    return out if out.dtype == q.dtype else out.to(q.dtype)


_IO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()
