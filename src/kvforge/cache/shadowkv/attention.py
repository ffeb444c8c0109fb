"""Attention of one sequence's step over several key/value parts with one softmax.

ShadowKV's decode attends over outlier chunks, the selected (reconstructed) chunks, the
exact local/generated window and the step's own tokens. The parts are not concatenated:
scores are computed part by part, joined (scores are small: heads x queries x keys), one
softmax is taken, and each part's values are weighted with its slice of the
probabilities. Every part lies before the step's first query, so it is fully visible
(up to its mask); the step's own keys are causal.

Shapes: q [Q, heads, D] (RoPE applied); a part's keys/values [H, L, D] (H KV heads,
query head h reads KV head h // (heads / H)), mask [H, L] bool (True: attended) or None.
Values at masked slots must be finite (they are weighted by exactly 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    keys: torch.Tensor  # [H, L, D]
    values: torch.Tensor  # [H, L, D]
    mask: torch.Tensor | None = None  # [H, L] bool


def sparse_attention(q: torch.Tensor, parts: Sequence[Part], own_keys: torch.Tensor, own_values: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Output [Q, heads, D] in q's dtype, computed in float32. own_keys/own_values
    [H, Q, D] are the step's tokens: query i sees own tokens 0..i."""
    queries, heads, dim = q.shape
    kv_heads = own_keys.shape[0]
    group = heads // kv_heads
    # rows of a KV head: query token i, group member g -> row i * group + g
    qh = (q.float() * scale).view(queries, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
    scores = []
    for part in parts:
        s = torch.bmm(qh, part.keys.float().transpose(1, 2))
        if part.mask is not None:
            s = s.masked_fill(~part.mask[:, None, :], float("-inf"))
        scores.append(s)
    own = torch.bmm(qh, own_keys.float().transpose(1, 2))
    if queries > 1:
        row_token = torch.arange(queries, device=q.device).repeat_interleave(group)
        hidden = row_token[:, None] < torch.arange(queries, device=q.device)[None, :]
        own = own.masked_fill(hidden[None], float("-inf"))
    scores.append(own)
    # The own token is always visible, so every row has a finite maximum: no NaN.
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = None
    start = 0
    for values in [p.values for p in parts] + [own_values]:
        length = values.shape[1]
        term = torch.bmm(probs[:, :, start:start + length], values.float())
        out = term if out is None else out + term
        start += length
    assert out is not None
    return out.view(kv_heads, queries, group, dim).transpose(0, 1).reshape(queries, heads, dim).to(q.dtype)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """One decode query q [heads, D] over one buffer keys/values [H, R, D] with mask [H, R]
    (None: every row; else at least one True per head: the step's own token, which the
    caller wrote into the buffer). Output [heads, D] in q's dtype, float32 inside."""
    heads, dim = q.shape
    kv_heads = keys.shape[0]
    qh = (q.float() * scale).view(kv_heads, heads // kv_heads, dim)
    scores = torch.bmm(qh, keys.float().transpose(1, 2))
    if mask is not None:
        scores.masked_fill_(~mask[:, None, :], float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), values.float()).view(heads, dim).to(q.dtype)
