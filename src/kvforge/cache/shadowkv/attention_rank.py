"""`rank=attention`: a layer's rank from what its low-rank keys do to attention, not from
the keys' energy alone.

Why: the share of the keys' squared norm a rank retains does not tell how much attention
changes. On smollm2-135m a layer needs most of its directions to hold nearly all of the key
energy, yet its decode perplexity barely moves with the rank; gemma3-270m's global layers,
which attend far back, need their tail (docs/cache-methods.md#quality-settings and the front
there). Measuring the attention change itself separates the two.

The rule: at compression, the last few queries of the prompt (post-RoPE, seen by the
compressing step's attention) attend over the layer's keys twice: exact, and with every
key that compression does not keep exact replaced by its rank-r reconstruction (the same
`A @ B` and RoPE the sparse path applies). The error is ||O_r - O|| / ||O|| over those
queries and all heads (Frobenius). The rank is the smallest multiple of `step` above
`least` (or the width) whose error is at most `target`, found by bisection: the error is
not strictly monotone in r, so the result is a rank that meets the target whose next
smaller candidate does not, not always the smallest.

Cost per evaluated rank: one reconstruction (n x r x W) and one attention of m queries
over n keys; with m <= 16 and about log2(W / step) evaluations this is small next to the
prefill that produced the n keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvforge.rope import PositionedRope


@dataclass(frozen=True)
class QuerySample:
    """Post-RoPE queries [m, heads, D] of one sequence at positions [m], seen by a cache
    layer in the step that compresses it (the prompt's last rows)."""

    queries: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class AttentionProbe:
    """Everything the error of a rank needs for one layer of one sequence: keys_pre [n, W]
    and their orthonormal directions [W, W] (largest first), keys_post/values [H, n, D] of
    positions 0..n-1, `exact` [H, n] the keys compression keeps exact, the query sample
    and the attention scale."""

    keys_pre: torch.Tensor
    directions: torch.Tensor
    keys_post: torch.Tensor
    values: torch.Tensor
    exact: torch.Tensor
    sample: QuerySample
    rope: PositionedRope
    scale: float

    def _attend(self, keys_post: torch.Tensor) -> torch.Tensor:
        """Outputs [H, m x group, D] of the sample over keys_post [H, n, D] (causal)."""
        heads, n, dim = keys_post.shape
        q = self.sample.queries.float()
        m = q.shape[0]
        group = q.shape[1] // heads
        qh = q.view(m, heads, group, dim).permute(1, 0, 2, 3).reshape(heads, m * group, dim)
        scores = torch.bmm(qh, keys_post.float().transpose(1, 2)) * self.scale  # [H, m*g, n]
        key_positions = torch.arange(n, device=q.device)
        future = key_positions[None, :] > self.sample.positions.to(q.device).repeat_interleave(group)[:, None]
        scores.masked_fill_(future[None], float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), self.values.float())

    @functools.cached_property
    def coefficients(self) -> torch.Tensor:
        """keys_pre on every direction [n, W]: a rank-r rebuild is its first r columns times
        the first r directions, so the projection is made once for all ranks tried."""
        return self.keys_pre.float() @ self.directions.float().T

    def error(self, rank: int, exact_out: torch.Tensor | None = None) -> float:
        """Relative output error of the sample at `rank` (0.0 when every key is exact)."""
        exact_out = self._attend(self.keys_post) if exact_out is None else exact_out
        heads, n, dim = self.keys_post.shape
        approx_pre = (self.coefficients[:, :rank] @ self.directions[:rank].float()).view(n, heads, dim)
        positions = torch.arange(n, device=approx_pre.device)
        approx_post = self.rope.apply_at(approx_pre, positions).transpose(0, 1)
        keys = torch.where(self.exact[:, :, None], self.keys_post.float(), approx_post)
        out = self._attend(keys)
        return float(torch.linalg.norm(out - exact_out) / torch.linalg.norm(exact_out).clamp_min(1e-30))


def attention_rank(probe: AttentionProbe, target: float, least: int, step: int) -> int:
    """The rank the rule picks (see the module docstring) within [least, W]."""
    width = probe.directions.shape[0]
    candidates = sorted({min(width, r) for r in range(least, width + step, step)})
    exact_out = probe._attend(probe.keys_post)
    low, high = 0, len(candidates) - 1  # candidates[high] always meets the target (the full width)
    while low < high:
        middle = (low + high) // 2
        if probe.error(candidates[middle], exact_out) <= target:
            high = middle
        else:
            low = middle + 1
    return candidates[high]
