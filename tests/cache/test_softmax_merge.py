"""The merge helpers against plain softmax attention over the union of the parts' keys,
including rows that see no key of a later part (lse -inf, scores all -inf)."""

from __future__ import annotations

import math

import torch

from kvforge.cache.softmax_merge import LseMerge, OnlineSoftmax

HEADS, ROWS, KEYS, DIM = 3, 6, 40, 16
BOUNDS = (0, 9, 25, 40)  # three parts of the keys


def _problem(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores [H, rows, keys] with hidden keys at -inf, and values [H, keys, D]. Every row sees
    a key of the first part; row 1 sees no key of the second part, row 4 none of the third,
    row 5 none after the first."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(HEADS, ROWS, KEYS, generator=generator) * 3
    values = torch.randn(HEADS, KEYS, DIM, generator=generator)
    visible = torch.rand(HEADS, ROWS, KEYS, generator=generator) > 0.3
    visible[:, :, 0] = True
    visible[:, 1, BOUNDS[1]:BOUNDS[2]] = False
    visible[:, 4, BOUNDS[2]:] = False
    visible[:, 5, BOUNDS[1]:] = False
    return scores.masked_fill(~visible, -math.inf), values


def _attention(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention and its log-sum-exp; a row that sees nothing: out 0, lse -inf."""
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1))
    return probs @ values, lse


def _parts(scores: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(scores[..., lo:hi], values[:, lo:hi]) for lo, hi in zip(BOUNDS, BOUNDS[1:])]


def test_lse_merge_of_parts_equals_attention_over_their_union():
    scores, values = _problem(0)
    whole, whole_lse = _attention(scores, values)
    parts = [_attention(s, v) for s, v in _parts(scores, values)]
    assert torch.isneginf(parts[1][1][:, 1]).all() and torch.isneginf(parts[2][1][:, 4]).all()
    merge = LseMerge(*parts[0])
    for out, lse in parts[1:]:
        merge.add(out, lse)
    assert torch.isfinite(merge.out).all()
    torch.testing.assert_close(merge.out, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merge.lse, whole_lse, rtol=1e-5, atol=1e-5)
    # a row that sees only the first part keeps the first part's result exactly
    assert torch.equal(merge.out[:, 5], parts[0][0][:, 5]) and torch.equal(merge.lse[:, 5], parts[0][1][:, 5])


def test_online_softmax_over_tiles_equals_attention_over_their_union():
    scores, values = _problem(1)
    whole, _ = _attention(scores, values)
    (first_scores, first_values), *rest = _parts(scores, values)
    state = OnlineSoftmax.first_tile(first_scores, first_values)
    for tile_scores, tile_values in rest:
        state.add(tile_scores, tile_values)
    assert torch.isfinite(state.result()).all()
    torch.testing.assert_close(state.result(), whole, rtol=1e-5, atol=1e-5)
    alone = OnlineSoftmax.first_tile(first_scores, first_values).result()
    torch.testing.assert_close(state.result()[:, 5], alone[:, 5], rtol=0, atol=0)


def test_online_softmax_seeded_with_one_key_and_weighed_by_a_callable():
    """The decode form: the own key (weight 1) seeds the state; `weigh` replaces probs @ values."""
    scores, values = _problem(2)
    own_scores = torch.randn(HEADS, ROWS, 1)
    own_values = torch.randn(HEADS, 1, DIM)
    whole, _ = _attention(torch.cat((own_scores, scores), dim=-1), torch.cat((own_values, values), dim=1))
    state = OnlineSoftmax.one_key(own_scores, own_values)
    weighed = OnlineSoftmax.one_key(own_scores, own_values)
    for tile_scores, tile_values in _parts(scores, values):
        state.add(tile_scores, tile_values)
        weighed.add(tile_scores, tile_values, weigh=lambda probs, v=tile_values: torch.bmm(probs, v))
    torch.testing.assert_close(state.result(), whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(weighed.result(), state.result())
