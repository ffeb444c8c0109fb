"""RMSNorm, rotary embedding and the gated MLP's SiLU-gate (or GELU-tanh gate) as Triton
kernels: each one launch where the PyTorch expression is several (RMSNorm: pow, mean, add,
rsqrt, two muls and two casts, and when asked a layer's residual add with it, and Gemma's
norm of the added branch; RoPE: two slices, a negation, a cat, two muls, an add). A decode
step runs these on a few rows, so on a GPU each is launch overhead rather than work.

Each computes its PyTorch reference (models/layers.py, rope.py) with the same roundings to
the input dtype: RMSNorm normalises in float32 and rounds before the weight (Llama) or
scales by (1 + w) in float32 (Gemma), after rounding the residual sum as `x + delta` does;
RoPE rounds both products and their sum; the SiLU- and GELU-tanh gates round the
activation and the product. Results are not bitwise on a GPU (rsqrt/exp approximations,
contracted multiply-adds; the norm kernel launches without contraction, so its fused sums
are bitwise the ops apart): tests hold them to the references' tolerance.

The launchers take contiguous tensors of one float dtype, except that RoPE's x and
SiLU-gate's 2-D inputs need only contiguous rows (the slices of a packed projection's
output); `cuda_fused.py` checks this and picks these kernels on CUDA. On CPU tensors they
run only in Triton's interpreter (TRITON_INTERPRET=1 when kernels/triton_jit.py was
imported), which is how the tests run them. Importing this module imports triton.
"""

from __future__ import annotations

import torch

from kvforge.kernels.row_layout import rows_contiguous
from kvforge.kernels.triton_jit import INTERPRETED, jit, tl, triton

__all__ = ["add_norm_of_triton", "add_rms_norm_triton", "gelu_tanh_mul_triton", "rms_norm_triton", "rope_rotate_triton",
           "silu_mul_triton"]

GATE_BLOCK = 1024  # elements per program of the gated activations (silu_mul, gelu_tanh_mul)


@jit
def _norm_row(x, w_ptr, cols, ok, dim, eps, dtype: tl.constexpr, GEMMA: tl.constexpr):
    """RMSNorm of one row x (float32, zero past `dim`) by the weight at w_ptr, in `dtype`."""
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    normed = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps))
    if GEMMA:
        out = normed * (1.0 + w)
    else:
        out = w * normed.to(dtype).to(tl.float32)  # rounded before the weight, as the reference
    return out.to(dtype)


@jit
def _rms_norm_kernel(x_ptr, delta_ptr, delta_w_ptr, sum_ptr, w_ptr, out_ptr, dim, eps, delta_eps,
                     GEMMA: tl.constexpr, ADD: tl.constexpr, NORM_DELTA: tl.constexpr, NORM_OUT: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """One row per program: out = norm(x) (NORM_OUT alone); with ADD, the residual add first,
    x + delta (or + norm(delta) by its own weight with NORM_DELTA: Gemma's sandwich norms)
    rounded to the dtype as the reference's sum is, stored at sum_ptr, and normed if NORM_OUT."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if ADD:
        delta = tl.load(delta_ptr + row * dim + cols, mask=ok, other=0.0).to(tl.float32)
        if NORM_DELTA:
            delta = _norm_row(delta, delta_w_ptr, cols, ok, dim, delta_eps, dtype, GEMMA).to(tl.float32)
        x = (x + delta).to(dtype)
        tl.store(sum_ptr + row * dim + cols, x, mask=ok)
        x = x.to(tl.float32)
    if NORM_OUT:
        tl.store(out_ptr + row * dim + cols, _norm_row(x, w_ptr, cols, ok, dim, eps, dtype, GEMMA), mask=ok)


@jit
def rope_halves(x_ptr, x_base, cos_ptr, sin_ptr, row, dim, half, d, ok, dtype: tl.constexpr):
    """RoPE of one row's heads: x at x_ptr + x_base (first halves; [heads, half] offsets, `d`
    the offsets within a half, `ok` the mask), the row's cos/sin [dim]. Returns the rotated
    (first, second) halves in `dtype`: x1 cos1 - x2 sin1 and x2 cos2 + x1 sin2
    (rotate_half(x) = cat(-x2, x1)), each product and the sum rounded to `dtype` as the
    PyTorch expression rounds them. Shared by `_rope_kernel` and `full`'s RoPE-and-store."""
    x1 = tl.load(x_ptr + x_base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_base + half, mask=ok, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + row * dim + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + row * dim + half + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + row * dim + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + row * dim + half + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
    first = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    second = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    return first.to(dtype), second.to(dtype)


@jit
def _rope_kernel(x_ptr, x_row_stride, cos_ptr, sin_ptr, out_ptr, heads, dim, half,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # One program per row: every head of it (rope_halves). x's rows start x_row_stride apart
    # (a slice of a packed q/k/v output); out is contiguous.
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    ok = (h < heads)[:, None] & (d < half)[None, :]
    within = h[:, None] * dim + d[None, :]
    base = row * heads * dim + within
    x_base = row * x_row_stride + within
    first, second = rope_halves(x_ptr, x_base, cos_ptr, sin_ptr, row, dim, half, d, ok, out_ptr.dtype.element_ty)
    tl.store(out_ptr + base, first, mask=ok)
    tl.store(out_ptr + base + half, second, mask=ok)


@jit
def _gate_mul_kernel(gate_ptr, gate_row_stride, up_ptr, up_row_stride, out_ptr, cols, GELU_TANH: tl.constexpr,
                     BLOCK: tl.constexpr):
    # Programs over (row, block of columns): gate's and up's rows start at their own strides
    # (the halves of a packed gate/up output), out is contiguous [rows, cols].
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < cols
    gate = tl.load(gate_ptr + row * gate_row_stride + offsets, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + offsets, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GELU_TANH:  # 0.5 g (1 + tanh(y)) = g sigmoid(2y), y = sqrt(2 / pi) (g + 0.044715 g^3)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        # no cancellation on either tail; the exponent capped below float32's overflow (where
        # the product is 0 within a float32 either way)
        act = gate / (1.0 + tl.exp(tl.minimum(-2.0 * inner, 80.0)))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * cols + offsets, (act.to(dtype).to(tl.float32) * up).to(dtype), mask=ok)


def _check(*tensors: torch.Tensor, rows_apart: int = 0) -> None:
    """CUDA (or interpreted), one dtype, contiguous; the first `rows_apart` tensors need only
    contiguous rows (row_layout.rows_contiguous)."""
    if triton is None:
        raise RuntimeError("the fused Triton ops need the `triton` package (pip install 'kvforge[triton]')")
    for i, t in enumerate(tensors):
        if not (t.is_cuda or INTERPRETED):
            raise ValueError("the fused Triton ops run on CUDA tensors (or on CPU tensors when TRITON_INTERPRET=1 "
                             "was set before kvforge.kernels.triton_jit was imported)")
        if not (rows_contiguous(t) if i < rows_apart else t.is_contiguous()) or t.dtype != tensors[0].dtype:
            raise ValueError(f"the fused Triton ops take contiguous tensors of one dtype, got {t.dtype} "
                             f"(contiguous: {t.is_contiguous()}) beside {tensors[0].dtype}")


def _warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """RMSNorm of the last dim of x (Llama's w * norm(x), or Gemma's (1 + w) * norm(x))."""
    _check(x, weight)
    out = torch.empty_like(x)
    _launch_rms_norm(x, None, None, None, weight, out, eps, 0.0, gemma)
    return out


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool,
                        delta_weight: torch.Tensor | None = None,
                        delta_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, RMSNorm of it) in one launch, d = delta or, given `delta_weight`, delta's own
    RMSNorm (Gemma's post-attention norm): a decoder layer's residual add and the norm(s)
    around it. Each norm is `rms_norm_triton`'s code and the sum is rounded to x's dtype, as
    the ops run apart round it."""
    _check(x, delta, weight, *(() if delta_weight is None else (delta_weight,)))
    _same_shape(x, delta)
    total, out = torch.empty_like(x), torch.empty_like(x)
    _launch_rms_norm(x, delta, delta_weight, total, weight, out, eps, delta_eps, gemma)
    return total, out


def add_norm_of_triton(x: torch.Tensor, delta: torch.Tensor, delta_weight: torch.Tensor, delta_eps: float,
                       gemma: bool) -> torch.Tensor:
    """x + RMSNorm(delta) in one launch (Gemma's post-feedforward norm and the residual add)."""
    _check(x, delta, delta_weight)
    _same_shape(x, delta)
    total = torch.empty_like(x)
    _launch_rms_norm(x, delta, delta_weight, total, None, None, 0.0, delta_eps, gemma)
    return total


def _same_shape(x: torch.Tensor, delta: torch.Tensor) -> None:
    if delta.shape != x.shape:
        raise ValueError(f"the fused residual add: delta {tuple(delta.shape)} is not shaped as x {tuple(x.shape)}")


def _launch_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, delta_weight: torch.Tensor | None,
                     total: torch.Tensor | None, weight: torch.Tensor | None, out: torch.Tensor | None, eps: float,
                     delta_eps: float, gemma: bool) -> None:
    """A launch of `_rms_norm_kernel`; the flags follow from which tensors are given (pointers
    a launch does not use are passed as x, never read or written)."""
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    if rows:
        block = triton.next_power_of_2(dim)
        add, norm_out = delta is not None, out is not None

        def given(t: torch.Tensor | None) -> torch.Tensor:
            return x if t is None else t

        # No contraction into fused multiply-adds: in float32 a branch's norm (a product) would
        # fuse with the residual add and round once, where the ops run apart round twice. Off
        # for every launch of the kernel, so the lone norm and the fused ones stay one code.
        with torch.cuda.device_of(x):
            _rms_norm_kernel[(rows,)](x, given(delta), given(delta_weight), given(total), given(weight), given(out),
                                      dim, float(eps), float(delta_eps), GEMMA=bool(gemma), ADD=add,
                                      NORM_DELTA=delta_weight is not None, NORM_OUT=norm_out, BLOCK_D=block,
                                      num_warps=_warps(block), enable_fp_fusion=False)


def rope_rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` for x [rows, heads, head_dim], cos/sin [rows, head_dim]."""
    _check(x, cos, sin, rows_apart=1)
    rows, heads, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows and heads:
        half, block_h, block_half, warps = rope_launch(heads, dim)
        with torch.cuda.device_of(x):
            _rope_kernel[(rows,)](x, x.stride(0), cos, sin, out, heads, dim, half, BLOCK_H=block_h, BLOCK_HALF=block_half,
                                  num_warps=warps)
    return out


def rope_launch(heads: int, dim: int) -> tuple[int, int, int, int]:
    """(half, BLOCK_H, BLOCK_HALF, warps) of a one-program-per-row RoPE launch (rope_halves)."""
    half = dim // 2
    block_h, block_half = triton.next_power_of_2(heads), triton.next_power_of_2(half)
    return half, block_h, block_half, _warps(block_h * block_half)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up`, elementwise, in gate's dtype; 2-D gate and up may have rows that
    sit apart (the halves of a packed gate/up output), any other shape is contiguous."""
    return _gate_mul(gate, up, gelu_tanh=False)


def gelu_tanh_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.gelu(gate, approximate="tanh") * up` (Gemma's gated MLP), laid out as `silu_mul_triton`'s."""
    return _gate_mul(gate, up, gelu_tanh=True)


def _gate_mul(gate: torch.Tensor, up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    _check(gate, up, rows_apart=2 if gate.dim() == 2 else 0)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    cols = gate.shape[-1] if gate.dim() else 1
    rows = gate.numel() // cols if cols else 0
    if rows:
        # a contiguous tensor is [rows, cols] with rows cols apart, whatever its dims
        contiguous = gate.is_contiguous() and up.is_contiguous()
        gate_stride, up_stride = (cols, cols) if contiguous else (gate.stride(0), up.stride(0))
        with torch.cuda.device_of(gate):
            _gate_mul_kernel[(rows, triton.cdiv(cols, GATE_BLOCK))](gate, gate_stride, up, up_stride, out, cols,
                                                                    GELU_TANH=gelu_tanh, BLOCK=GATE_BLOCK)
    return out
