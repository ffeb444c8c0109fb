"""Fused CPU ops of a decoder layer (RMSNorm, rotary embedding) and the greedy argmax of a
step's logits, a C++ kernel built at first use.

Each replaces a chain of eager PyTorch ops by one call (see cpu_fused.cpp for the exact
arithmetic). At decode, where a step has one row per sequence, those chains are dispatch
overhead rather than work: with 30 layers about 600 dispatches per step.

`argmax_rows` is `torch.argmax(x, dim=-1)` of a [rows, vocab] tensor on x's own dtype, two
vectorised passes per row, where the sampler's greedy path made a float32 copy and then ran
ATen's argmax (docs/benchmarks.md#where-the-decode-speed-comes-from).

`silu_mul` is a gated MLP's `F.silu(gate) * up` in one pass instead of two eager ops
(docs/benchmarks.md#measurements-behind-design-choices).

`rms_norm`, `rope_rotate`, `silu_mul` and `argmax_rows` return None when the call is not eligible (another device,
float64, autograd needed, the kernel unavailable or disabled by
`KVFORGE_DISABLE_CPU_KERNELS=1`); the caller then runs its PyTorch expression, which stays
the reference (tests/kernels/test_cpu_fused.py holds the two together).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvforge.kernels.build import DEFAULT_FLAG_SETS, FLOAT_IO_DTYPES, CppKernel, kernels_disabled
from kvforge.kernels.row_layout import rows_contiguous

__all__ = ["argmax_rows", "fused_ops_available", "rms_norm", "rope_rotate", "silu_mul"]

# -ffp-contract=off: float32 RoPE stays exactly PyTorch's two rounded products and one sum.
_KERNEL = CppKernel(name="kvforge_cpu_fused", source=Path(__file__).with_name("cpu_fused.cpp"),
                    namespace="kvforge_cpu_fused", op="rms_norm", what="fused RMSNorm/RoPE kernel",
                    fallback="PyTorch ops",
                    flag_sets=tuple((*flags, "-ffp-contract=off") for flags in DEFAULT_FLAG_SETS))


def fused_ops_available() -> bool:
    """True when the compiled ops can be used (builds them on the first call)."""
    return _KERNEL.available()


def _eligible(*tensors: torch.Tensor, rows_apart: int = 0) -> bool:
    """The op can take these tensors; the first `rows_apart` of them only need contiguous
    rows (row_layout.rows_contiguous), the others must be contiguous."""
    dtype = tensors[0].dtype
    for i, t in enumerate(tensors):
        if t.dtype != dtype or not t.is_cpu or not (rows_contiguous(t) if i < rows_apart else t.is_contiguous()):
            return False
    if dtype not in FLOAT_IO_DTYPES:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return not kernels_disabled() and _KERNEL.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor | None:
    """RMSNorm of the last dim of x in one pass (Llama's w * norm(x), or Gemma's (1 + w)), or None."""
    if not _eligible(x, weight) or weight.dim() != 1 or x.dim() < 1 or weight.shape[0] != x.shape[-1]:
        return None
    return torch.ops.kvforge_cpu_fused.rms_norm(x, weight, float(eps), bool(gemma))


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """`x * cos + rotate_half(x) * sin` for x [rows, heads, head_dim], cos/sin [rows, head_dim], or None."""
    if (x.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[0]
            or cos.shape[1] != x.shape[2] or x.shape[2] % 2):
        return None
    if not _eligible(x, cos, sin, rows_apart=1):  # x may be a slice of a packed q/k/v projection
        return None
    return torch.ops.kvforge_cpu_fused.rope_rotate(x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`F.silu(gate) * up` in one pass with the same two roundings (gate's dtype), or None."""
    # 2-D gate and up may be the halves of a packed gate/up projection's output
    if gate.dim() < 1 or gate.shape != up.shape or not _eligible(gate, up, rows_apart=2 if gate.dim() == 2 else 0):
        return None
    return torch.ops.kvforge_cpu_fused.silu_mul(gate, up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """`torch.argmax(x, dim=-1)` (int64 [rows]) of x [rows, V], or None."""
    if x.dim() != 2 or x.shape[1] == 0 or not _eligible(x):
        return None
    return torch.ops.kvforge_cpu_fused.argmax_rows(x)
