"""The fused ops of a decoder layer on CUDA, one Triton launch each (triton_fused.py) where
the PyTorch expression is several: RMSNorm, alone or with a residual add (`add_rms_norm`,
`add_norm_of`), rotary embedding, and the MLP's SiLU-gate or GELU-tanh gate; and the
residual add after the MLP folded into its down projection's GEMM (`linear_into`, cuBLAS).

`rms_norm`, `rope_rotate` and `silu_mul` mirror `cpu_fused`'s (the residual adds and the
GELU gate have no CPU op): they return None when the call is not eligible (tensors not on
one CUDA device, of mixed or non-float dtypes, not contiguous (RoPE's x and the gates' 2-D inputs:
rows not contiguous), needing autograd; triton not installed;
`KVFORGE_DISABLE_TRITON_FUSED=1`), and the caller then runs its PyTorch expression, which
stays the reference (tests/kernels/test_triton_fused.py holds them together).
triton_fused.py, and with it triton, is imported at the first eligible call only, so CPU
runs never import triton.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kvforge.kernels.build import FLOAT_IO_DTYPES
from kvforge.kernels.row_layout import rows_contiguous
from kvforge.kernels.triton_runtime import triton_installed
from kvforge.step_timing import current_timer

__all__ = ["DISABLE_TRITON_FUSED_ENV", "add_norm_of", "add_rms_norm", "gelu_tanh_mul", "linear_into",
           "on_one_served_device", "rms_norm", "rope_rotate", "silu_mul", "triton_fused_enabled"]

DISABLE_TRITON_FUSED_ENV = "KVFORGE_DISABLE_TRITON_FUSED"
# The device the Triton ops serve; tests set "cpu" to run them in Triton's interpreter.
DEVICE_TYPE = "cuda"


def _kernels() -> ModuleType:
    from kvforge.kernels import triton_fused

    return triton_fused


def _eligible(*tensors: torch.Tensor, rows_apart: int = 0) -> bool:
    """The first `rows_apart` tensors need only contiguous rows (row_layout.rows_contiguous)."""
    dtype = tensors[0].dtype
    if not on_one_served_device([t.device for t in tensors]):
        return False
    for i, t in enumerate(tensors):
        laid_out = rows_contiguous(t) if i < rows_apart else t.is_contiguous()
        if t.dtype != dtype or not laid_out:
            return False
    if dtype not in FLOAT_IO_DTYPES:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return triton_fused_enabled()


def on_one_served_device(devices: list[torch.device]) -> bool:
    """All of `devices` are one device (type and index) of the type the ops serve. A launch
    runs on one GPU (the first tensor's) and would take another GPU's pointer for its own;
    torch's ops apart raise a clear error for operands on two devices instead."""
    first = devices[0]
    return first.type == DEVICE_TYPE and all(device == first for device in devices[1:])


def triton_fused_enabled() -> bool:
    """triton is installed and `KVFORGE_DISABLE_TRITON_FUSED` does not turn the fused ops off
    (read on every call; also the switch of `full`'s fused RoPE-and-store, cache/full/triton_store.py)."""
    return os.environ.get(DISABLE_TRITON_FUSED_ENV, "").strip() in ("", "0") and triton_installed()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor | None:
    """RMSNorm of the last dim of x in one launch (Llama's w * norm(x), or Gemma's (1 + w)), or None."""
    if x.device.type != DEVICE_TYPE or weight.dim() != 1 or x.dim() < 1 or weight.shape[0] != x.shape[-1]:
        return None
    return _kernels().rms_norm_triton(x, weight, eps, gemma) if _eligible(x, weight) else None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool,
                 delta_weight: torch.Tensor | None = None,
                 delta_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + d, RMSNorm of it) in one launch (a layer's residual add and the norm after it),
    d = delta or, given `delta_weight`, delta's own RMSNorm (Gemma's post-attention norm); or None."""
    if not _residual_shapes(x, delta, weight, delta_weight):
        return None
    if not _eligible(x, delta, weight, *(() if delta_weight is None else (delta_weight,))):
        return None
    return _kernels().add_rms_norm_triton(x, delta, weight, eps, gemma, delta_weight, delta_eps)


def add_norm_of(x: torch.Tensor, delta: torch.Tensor, delta_weight: torch.Tensor, delta_eps: float,
                gemma: bool) -> torch.Tensor | None:
    """x + RMSNorm(delta) in one launch (Gemma's post-feedforward norm and the residual add), or None."""
    if not _residual_shapes(x, delta, delta_weight) or not _eligible(x, delta, delta_weight):
        return None
    return _kernels().add_norm_of_triton(x, delta, delta_weight, delta_eps, gemma)


def _residual_shapes(x: torch.Tensor, delta: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """x and delta of one shape (no broadcast) on the served device, each weight 1-D over x's last dim."""
    if x.device.type != DEVICE_TYPE or x.dim() < 1 or delta.shape != x.shape:
        return False
    return all(w.dim() == 1 and w.shape[0] == x.shape[-1] for w in weights if w is not None)


def linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor | None:
    """`out += linear(x, weight)` in place, one GEMM (`addmm_`: the add happens in the GEMM's
    epilogue, where `out + linear(x, weight)` is a GEMM and an add launch); returns `out`, or
    None (then the caller adds apart, and `out` is untouched). The sum is rounded to the dtype
    once where the ops apart round the product first: not bitwise those ops, only closer to
    the exact sum. `out` is overwritten, so it must be the caller's own intermediate.
    Eligible: no bias, out [..., N] and x [..., K] with the same leading dims, weight [N, K],
    all contiguous, with `_eligible`'s rules (the `KVFORGE_DISABLE_TRITON_FUSED` switch too)."""
    if bias is not None or out.device.type != DEVICE_TYPE or out.dim() < 1 or x.dim() != out.dim():
        return None
    if x.shape[:-1] != out.shape[:-1] or weight.shape != (out.shape[-1], x.shape[-1]):
        return None
    if not _eligible(out, x, weight):
        return None
    gemm, operands = out.view(-1, out.shape[-1]).addmm_, (x.view(-1, x.shape[-1]), weight.t())
    timer = current_timer()  # a GEMM: a step's breakdown files it under "linear", as `cpu_linear.linear`
    if timer is not None:
        timer.measure("linear", gemm, *operands)
    else:
        gemm(*operands)
    return out


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """`x * cos + rotate_half(x) * sin` for x [rows, heads, head_dim], cos/sin [rows, head_dim], or None."""
    if (x.device.type != DEVICE_TYPE or x.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape
            or cos.shape[0] != x.shape[0] or cos.shape[1] != x.shape[2] or x.shape[2] % 2):
        return None
    # x may be a slice of a packed q/k/v projection's output
    return _kernels().rope_rotate_triton(x, cos, sin) if _eligible(x, cos, sin, rows_apart=1) else None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`F.silu(gate) * up` in one launch with the same two roundings (gate's dtype), or None."""
    return _gated(gate, up, "silu_mul_triton")


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`F.gelu(gate, approximate="tanh") * up` in one launch, laid out as `silu_mul`'s, or None."""
    return _gated(gate, up, "gelu_tanh_mul_triton")


def _gated(gate: torch.Tensor, up: torch.Tensor, launcher: str) -> torch.Tensor | None:
    if gate.device.type != DEVICE_TYPE or gate.dim() < 1 or gate.shape != up.shape:
        return None
    # 2-D gate and up may be the halves of a packed gate/up projection's output
    if not _eligible(gate, up, rows_apart=2 if gate.dim() == 2 else 0):
        return None
    return getattr(_kernels(), launcher)(gate, up)
