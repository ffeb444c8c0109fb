"""What the causal attention kernel's tests (bf16 and float32) check against: the float64
definition and seeded inputs."""

from __future__ import annotations

import torch


def definition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention of q [n, heads, D] (positions m - n ..) over k/v [kv_heads, m, D]; (out, lse)."""
    n, heads, _ = q.shape
    kv_heads, m, _ = k.shape
    group = heads // kv_heads
    kk = k.double().repeat_interleave(group, 0)
    vv = v.double().repeat_interleave(group, 0)
    scores = torch.einsum("nhd,hmd->hnm", q.double(), kk) * scale
    hidden = torch.arange(m)[None, :] > torch.arange(n)[:, None] + (m - n)
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hnm,hmd->nhd", torch.softmax(scores, -1), vv), torch.logsumexp(scores, -1)


def inputs(n: int, m: int, heads: int, kv_heads: int, dim: int, seed: int, dtype: torch.dtype,
           q_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded q [n, heads, dim] (times q_scale) and k, v [kv_heads, m, dim] of `dtype`."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, heads, dim, generator=g) * q_scale).to(dtype)
    k = torch.randn(kv_heads, m, dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, m, dim, generator=g).to(dtype)
    return q, k, v
