"""`full`'s write of a step's K/V in one Triton launch: RoPE of the keys and both page
stores, where the PyTorch path is three operations (the fused RoPE, then an `index_copy_`
per store). On a GPU each is a kernel launch per layer and step.

One program per row: it rotates the row's keys (the arithmetic of kernels/triton_fused.py's
RoPE: both products and their sum rounded to the keys' dtype), writes them to `k_out` (the
step's post-RoPE keys, which decode attention and the step's metadata read), and stores
the row's keys and values, cast to the pages' dtype, at the row's flat slot of every KV head.
The inputs may be slices of a packed q/k/v projection (rows apart, each row contiguous).

`FullCache.write` takes this path when its decode kernel is "triton" (CUDA; in the tests,
CPU tensors in Triton's interpreter), every row of the step is stored (no `write_rows`),
the pages are 16/32-bit, and the layouts and dtypes are the fused RoPE's
(`rope_store_applies`); the PyTorch path stays the reference (tests/cache/full/
test_full_triton_store.py holds them together, bitwise). Importing this module imports triton.
"""

from __future__ import annotations

import torch

from kvforge.kernels.build import FLOAT_IO_DTYPES
from kvforge.kernels.cuda_fused import triton_fused_enabled
from kvforge.kernels.row_layout import rows_contiguous
from kvforge.kernels.triton_fused import rope_halves, rope_launch
from kvforge.kernels.triton_jit import jit, tl, triton

__all__ = ["rope_and_store", "rope_store_applies"]


@jit
def _rope_store_kernel(k_ptr, k_row_stride, v_ptr, v_row_stride, cos_ptr, sin_ptr, k_out_ptr, k_pages_ptr,
                       v_pages_ptr, slots_ptr, heads, dim, half, page_head_stride,
                       BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    ok = (h < heads)[:, None] & (d < half)[None, :]
    within = h[:, None] * dim + d[None, :]
    page_dtype = k_pages_ptr.dtype.element_ty
    # RoPE exactly as the fused RoPE kernel computes it (rounded to the keys' dtype)
    first, second = rope_halves(k_ptr, row * k_row_stride + within, cos_ptr, sin_ptr, row, dim, half, d, ok,
                                k_out_ptr.dtype.element_ty)
    out = row * heads * dim + within
    tl.store(k_out_ptr + out, first, mask=ok)
    tl.store(k_out_ptr + out + half, second, mask=ok)
    # the row's slot in every head's pages [heads, pages x block, dim]
    slot = tl.load(slots_ptr + row)
    page = h[:, None] * page_head_stride + slot * dim + d[None, :]
    tl.store(k_pages_ptr + page, first.to(page_dtype), mask=ok)
    tl.store(k_pages_ptr + page + half, second.to(page_dtype), mask=ok)
    e = tl.arange(0, BLOCK_D)
    v_ok = (h < heads)[:, None] & (e < dim)[None, :]
    values = tl.load(v_ptr + row * v_row_stride + h[:, None] * dim + e[None, :], mask=v_ok, other=0.0)
    tl.store(v_pages_ptr + h[:, None] * page_head_stride + slot * dim + e[None, :], values.to(page_dtype), mask=v_ok)


def rope_store_applies(k_pre: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """The fused write computes what the PyTorch path would: the layouts and dtypes of the
    fused RoPE (k_pre and v [T, heads, D] with contiguous rows, cos/sin [T, D] contiguous,
    one float dtype, no autograd, `KVFORGE_DISABLE_TRITON_FUSED` unset), contiguous pages
    of one 16/32-bit dtype."""
    if k_pre.dim() != 3 or v.shape != k_pre.shape or cos.shape != (k_pre.shape[0], k_pre.shape[2]):
        return False
    if sin.shape != cos.shape or k_pre.shape[2] % 2 or not (rows_contiguous(k_pre) and rows_contiguous(v)):
        return False
    if not (cos.is_contiguous() and sin.is_contiguous() and k_pages.is_contiguous() and v_pages.is_contiguous()):
        return False
    if len({k_pre.dtype, v.dtype, cos.dtype, sin.dtype}) != 1 or k_pre.dtype not in FLOAT_IO_DTYPES:
        return False
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype or k_pages.dtype not in FLOAT_IO_DTYPES:
        return False
    if torch.is_grad_enabled() and (k_pre.requires_grad or v.requires_grad):
        return False
    return triton_fused_enabled()


def rope_and_store(k_pre: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rotate k_pre [T, heads, D], store it and v at `slots` [T] (flat page x block + offset)
    of one layer's pages [heads, pages, block, D]; returns the rotated keys [T, heads, D]."""
    rows, heads, dim = k_pre.shape
    k_out = torch.empty(k_pre.shape, dtype=k_pre.dtype, device=k_pre.device)
    if rows and heads:
        half, block_h, block_half, warps = rope_launch(heads, dim)
        with torch.cuda.device_of(k_pre):
            _rope_store_kernel[(rows,)](k_pre, k_pre.stride(0), v, v.stride(0), cos, sin, k_out, k_pages, v_pages,
                                        slots, heads, dim, half, k_pages.stride(0), BLOCK_H=block_h,
                                        BLOCK_HALF=block_half, BLOCK_D=triton.next_power_of_2(dim), num_warps=warps)
    return k_out
