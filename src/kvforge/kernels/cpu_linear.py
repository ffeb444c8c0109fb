"""Small-M linear on CPU (`y = x @ W.T + b` for decode steps), a C++ kernel built at first use.

With M <= 32 rows BLAS gemm streams the weights at a fraction of the memory bandwidth;
`torch.ops.kvforge_cpu_linear.small_m_linear` reads every weight row once while x stays in
cache (see cpu_linear.cpp). Weights may be float32, bfloat16 or float16 (x, W and bias of one
dtype, as F.linear wants); products and sums are float32 and the result is rounded once to
that dtype, so 2-byte weights halve the bytes a decode step reads without bf16 accumulation.
On a CPU with AMX, bf16 products whose shapes fit run as tile multiplies instead
(cpu_amx_linear.h; the choice depends on the shapes, never on M).
`linear` dispatches to it for eligible calls; other calls (prefill, float64, autograd, no
kernel) run on the weight's oneDNN-packed copy where the engine made one (cpu_prepack.py),
else `torch.nn.functional.linear`.

Invariant: with the kernel, each output element's summation order does not depend on M nor
on the other rows of x, so row i of `linear(x, W)` is bitwise equal to `linear(x[i:i+1], W)`
(batched and single-sequence decode agree exactly). It differs from F.linear by rounding.

Built lazily by `small_m_linear_available()` through `kvforge.kernels.build`; a build
failure is logged once and `linear` falls back. `KVFORGE_DISABLE_CPU_KERNELS=1` forces
the fallback.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from kvforge.kernels.build import DEFAULT_FLAG_SETS, DISABLE_ENV, FLOAT_IO_DTYPES, CppKernel, kernels_disabled
from kvforge.kernels.cpu_prepack import has_widened_copy, packed_linear, packed_linear_float32
from kvforge.step_timing import current_timer

__all__ = ["DISABLE_ENV", "KERNEL_DTYPES", "MAX_ROWS", "linear", "linear_float32", "linear_from",
           "small_m_eligible", "small_m_linear_available", "widened_input"]

KERNEL_DTYPES = FLOAT_IO_DTYPES
MAX_ROWS = 32  # more rows: BLAS is as good (it is compute-bound then) and is used instead

# -ffp-contract=off keeps the portable path's a * b + c unfused everywhere, so the
# M-invariance does not hinge on the compiler's contraction choices (intrinsics are explicit).
_KERNEL = CppKernel(name="kvforge_cpu_linear", source=Path(__file__).with_name("cpu_linear.cpp"),
                    namespace="kvforge_cpu_linear", op="small_m_linear", what="small-M linear kernel",
                    fallback="torch.nn.functional.linear",
                    flag_sets=tuple((*flags, "-ffp-contract=off") for flags in DEFAULT_FLAG_SETS))


def small_m_linear_available() -> bool:
    """True when the compiled kernel can be used (builds it on the first call)."""
    return _KERNEL.available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the small-M kernel when the call is eligible.

    Eligible: CPU x with at most MAX_ROWS rows once leading dims are flattened, a contiguous
    2-D CPU weight (nn.Linear layout [N, K]) and a CPU bias or none, all of one dtype in
    KERNEL_DTYPES,
    no autograd needed (the op has no backward), the kernel built and not disabled.
    Counted as "linear" by a recording step timer (kvforge.step_timing).
    """
    timer = current_timer()
    if timer is not None:
        return timer.measure("linear", _linear, x, weight, bias)
    return _linear(x, weight, bias)


def widened_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x widened to float32 (exactly) when it is prompt-sized, needs no autograd and `weight`'s
    product runs widened (a bf16 weight with a float32 packed copy), else x itself: a caller
    that multiplies one x by several such weights (q, k, v; gate, up) widens it once, then
    passes both to `linear_from` (or the widened one to `linear_float32`)."""
    if (x.dtype != torch.bfloat16 or x.numel() <= MAX_ROWS * x.shape[-1] or not has_widened_copy(weight)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return x
    return x.float()


def linear_from(x: torch.Tensor, wide: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(x, weight, bias)`, computed from `wide` (`widened_input(x, some weight)`) where
    this weight has a current widened copy; in x's dtype either way, so a weight without the
    copy (never packed, or changed since) takes x as it is."""
    if wide is not x and has_widened_copy(weight):
        return linear(wide, weight, bias)
    return linear(x, weight, bias)


def linear_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`x @ weight.T + bias` in float32, unrounded, for a prompt-sized x (more than MAX_ROWS
    rows) when `weight` has a float32-widened packed copy (cpu_prepack.packed_linear_float32),
    else None. Counted as "linear" like `linear`."""
    if x.numel() <= MAX_ROWS * x.shape[-1] or not has_widened_copy(weight):
        return None
    timer = current_timer()
    if timer is not None:
        return timer.measure("linear", packed_linear_float32, x, weight, bias)
    return packed_linear_float32(x, weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if small_m_eligible(x, weight, bias):
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        if x.dim() == 2 and x.is_contiguous():  # the decode step's shape: no reshape, no view
            return torch.ops.kvforge_cpu_linear.small_m_linear(x, weight, bias)
        rows = x.reshape(-1, weight.shape[1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.kvforge_cpu_linear.small_m_linear(rows, weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    out = packed_linear(x, weight, bias)
    return F.linear(x, weight, bias) if out is None else out


def small_m_eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear(x, weight, bias)` runs on the small-M kernel (the rule in `linear`)."""
    # Ordered cheapest first: this runs for every projection of every decode step (211 calls
    # a step on smollm2), so each check is an attribute read where one will do.
    if x.dtype != weight.dtype or x.dtype not in KERNEL_DTYPES or not x.is_cpu or not weight.is_cpu:
        return False
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or not weight.is_contiguous():
        return False
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows < 1 or rows > MAX_ROWS:
        return False
    if bias is not None and (bias.dtype != x.dtype or not bias.is_cpu or bias.dim() != 1):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    return not kernels_disabled() and _KERNEL.available()
