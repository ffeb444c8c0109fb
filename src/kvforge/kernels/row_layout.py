"""Which tensors the fused elementwise ops take: contiguous ones, and for RoPE and SiLU-gate
also tensors whose rows sit apart in memory while each row is contiguous, as the slices of
a packed projection's output are (q, k and v of one q/k/v GEMM; gate and up of one gate/up
GEMM: models/packed_projections.py). Reading those slices in place saves a copy per slice.
`last_dim_contiguous` is the Triton decode kernels' one requirement of a step's q/k/v."""

from __future__ import annotations

import torch


def rows_contiguous(t: torch.Tensor) -> bool:
    """True when every dimension of t but the first is laid out contiguously (t[i] is a
    contiguous block for every i), wherever the rows themselves start: t.stride(0) is free."""
    if t.is_contiguous():
        return True
    if t.dim() < 2:
        return False
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride in its last dimension (what the Triton decode kernels address per
    element), copied only when it has not: a packed projection's slice is taken as it is."""
    return t if t.stride(-1) == 1 else t.contiguous()
