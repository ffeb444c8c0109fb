"""ShadowKV building blocks on hand-made inputs: landmark scores and top-k, outlier chunks
by min cosine similarity, the low-rank key basis, and the attention over parts."""

from __future__ import annotations

import math

import pytest
import torch

from kvforge.cache.attention import reference_attention
from kvforge.cache.shadowkv.attention import Part, masked_attention, sparse_attention
from kvforge.cache.shadowkv.compress import compress_layer
from kvforge.cache.shadowkv.lowrank import key_basis, project, reconstruct, relative_error
from kvforge.cache.shadowkv.select import (
    chunk_landmarks,
    chunk_min_cosine,
    chunk_scores,
    outlier_chunks,
    top_chunks,
)
from kvforge.config import RopeConfig
from kvforge.models.rope import RotaryEmbedding


def test_landmarks_are_chunk_means():
    keys = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    landmarks = chunk_landmarks(keys, 4)
    assert landmarks.shape == (2, 2, 3)
    torch.testing.assert_close(landmarks[1, 0], keys[1, :4].mean(dim=0))
    torch.testing.assert_close(landmarks[0, 1], keys[0, 4:].mean(dim=0))


def test_outliers_are_the_chunks_with_the_lowest_min_cosine():
    """Chunks of 4 keys near a direction; chunk 2 of head 0 has one key pointing away and
    chunk 0 of head 1 one key at 90 degrees: they are the outliers of their heads."""
    torch.manual_seed(0)
    base = torch.tensor([1.0, 0.0, 0.0, 0.0])
    keys = base + 0.01 * torch.randn(2, 5 * 4, 4)
    keys[0, 9] = -base  # head 0, chunk 2
    keys[1, 2] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # head 1, chunk 0
    landmarks = chunk_landmarks(keys, 4)
    scores = chunk_min_cosine(keys, landmarks)
    assert scores.shape == (2, 5)
    assert scores[0].argmin() == 2 and scores[1].argmin() == 0
    assert torch.equal(outlier_chunks(scores, 1), torch.tensor([[2], [0]]))
    two = outlier_chunks(scores, 2)
    assert two.shape == (2, 2) and bool((two[:, 1] > two[:, 0]).all())  # ascending ids
    assert outlier_chunks(scores, 9).shape == (2, 5)  # capped at the number of chunks


def test_top_k_chunks_follow_the_landmark_scores():
    """One sequence, 2 KV heads, 2 query heads per group, 6 chunks. Landmarks are unit
    vectors; each query head points at one chunk, so the max over the group selects the
    chunks its two heads point at. Chunk 1 is the best match of head 0 but is not a
    candidate (an outlier): it must not be picked."""
    dim, chunks = 6, 6
    eye = torch.eye(dim)
    landmarks = torch.stack([eye, eye])[:, None]  # [H=2, B=1, 6, 6]: chunk c = e_c
    q = torch.zeros(1, 1, 4, dim)
    q[0, 0, 0, 1], q[0, 0, 0, 3] = 9.0, 4.0  # head 0 of group 0: chunk 1 best, chunk 3 next
    q[0, 0, 1, 5] = 6.0  # head 1 of group 0: chunk 5
    q[0, 0, 2, 0] = 5.0  # group 1: chunks 0 and 2
    q[0, 0, 3, 2] = 7.0
    candidates = torch.ones(1, 2, chunks, dtype=torch.bool)
    candidates[0, 0, 1] = False
    scores = chunk_scores(q, landmarks, candidates, scale=1.0)
    assert scores.shape == (1, 2, chunks) and torch.isinf(scores[0, 0, 1])
    picks, valid = top_chunks(scores, 2)
    assert valid.all()
    assert set(picks[0, 0].tolist()) == {3, 5} and set(picks[0, 1].tolist()) == {0, 2}
    # every score is a softmax probability, maxed over the group
    probs = torch.softmax(torch.tensor([0.0, 0, 0, 4, 0, 0]).masked_fill(~candidates[0, 0], -math.inf), dim=0)
    assert abs(float(scores[0, 0, 3]) - float(probs[3])) < 1e-6


def test_scores_sum_over_query_tokens_and_invalid_picks():
    """Two query tokens each preferring a different chunk: both chunks score ~1 (the sum
    over tokens). Asking for more chunks than there are candidates marks the extra picks
    invalid."""
    landmarks = torch.eye(3)[None, None]  # 1 KV head, 1 sequence, 3 chunks
    q = torch.zeros(1, 2, 1, 3)
    q[0, 0, 0, 0] = q[0, 1, 0, 2] = 30.0
    candidates = torch.tensor([[[True, False, True]]])
    scores = chunk_scores(q, landmarks, candidates, scale=1.0)
    assert scores[0, 0, 0] > 0.99 and scores[0, 0, 2] > 0.99
    picks, valid = top_chunks(scores, 3)
    assert sorted(picks[0, 0, :2].tolist()) == [0, 2] and valid[0, 0].tolist() == [True, True, False]


def test_reconstruction_error_falls_with_rank_and_matches_the_svd():
    """Keys of rank 6 plus noise: the rank-r error of our basis equals the optimal one
    (Eckart-Young, from torch's SVD), falls with r, and is rounding at full rank."""
    torch.manual_seed(1)
    keys = torch.randn(300, 6) @ torch.randn(6, 24) * 3 + 0.05 * torch.randn(300, 24)
    singular = torch.linalg.svdvals(keys.double())
    errors = [relative_error(keys, r) for r in (1, 2, 4, 6, 12, 24)]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 1e-5
    for rank, error in zip((1, 2, 4, 6, 12), errors):
        optimal = float(singular[rank:].square().sum().sqrt() / singular.square().sum().sqrt())
        assert abs(error - optimal) < 1e-4 * max(1.0, optimal) + 1e-6
    basis = key_basis(keys, 6)
    torch.testing.assert_close(basis @ basis.T, torch.eye(6), atol=1e-5, rtol=0)
    assert reconstruct(project(keys, basis), basis).shape == keys.shape


def _rope(dim: int):
    return RotaryEmbedding(dim, RopeConfig(theta=10000.0)).at(torch.arange(1), torch.float32)


def test_compress_layer_keeps_outliers_and_window_exact():
    """Full rank: coefficients x basis give back the pre-RoPE keys; the buffers hold the
    outlier chunks' exact keys/values first and then the tail after the prefix."""
    torch.manual_seed(2)
    heads, n, dim, chunk = 2, 37, 8, 4
    rope = _rope(dim)
    keys_pre = torch.randn(n, heads, dim) + 2.0
    keys_post = rope.apply_at(keys_pre, torch.arange(n)).transpose(0, 1)
    values = torch.randn(heads, n, dim)
    prefix = 28
    layer, data = compress_layer(keys_post, values, rope, prefix, heads * dim, chunk, 2, window_capacity=12,
                                 chunks_per_step=3)
    rebuilt = (data.coefficients.reshape(prefix, -1) @ layer.basis).view(prefix, heads, dim)
    torch.testing.assert_close(rebuilt, keys_pre[:prefix], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(data.values, values[:, :prefix].reshape(heads, 7, chunk, dim))
    assert layer.outliers.shape == (heads, 2) and layer.slot_ids.eq(-1).all()
    for h in range(heads):
        for i, c in enumerate(layer.outliers[h].tolist()):
            torch.testing.assert_close(layer.keys[h, i * chunk:(i + 1) * chunk], keys_post[h, c * chunk:(c + 1) * chunk])
            torch.testing.assert_close(layer.values[h, i * chunk:(i + 1) * chunk], values[h, c * chunk:(c + 1) * chunk])
    window_start = 2 * chunk + 3 * chunk  # after the outliers and the reuse slots
    torch.testing.assert_close(layer.keys[:, window_start:window_start + n - prefix], keys_post[:, prefix:])
    assert layer.keys.shape[1] == window_start + 12 + 1


@pytest.mark.parametrize("queries", [1, 5])
def test_sparse_attention_equals_reference(queries):
    """Parts with masks + the step's own causal tokens == reference attention over the
    unmasked keys (GQA: 6 query heads on 2 KV heads)."""
    torch.manual_seed(3)
    kv_heads, heads, dim = 2, 6, 8
    parts = [Part(torch.randn(kv_heads, 11, dim), torch.randn(kv_heads, 11, dim)),
             Part(torch.randn(kv_heads, 9, dim), torch.randn(kv_heads, 9, dim), torch.rand(kv_heads, 9) > 0.4)]
    own_k, own_v = torch.randn(kv_heads, queries, dim), torch.randn(kv_heads, queries, dim)
    q = torch.randn(queries, heads, dim)
    got = sparse_attention(q, parts, own_k, own_v, 0.3)
    group = heads // kv_heads
    for h in range(heads):
        kv = h // group
        keys = [parts[0].keys[kv], parts[1].keys[kv][parts[1].mask[kv]], own_k[kv]]
        vals = [parts[0].values[kv], parts[1].values[kv][parts[1].mask[kv]], own_v[kv]]
        k, v = torch.cat(keys), torch.cat(vals)
        past = k.shape[0] - queries
        expected = reference_attention(q[:, h:h + 1], k[:, None], v[:, None], torch.arange(past, past + queries),
                                       torch.arange(k.shape[0]), 0.3, None)
        torch.testing.assert_close(got[:, h:h + 1], expected, atol=1e-5, rtol=1e-5)
    if queries == 1:
        buffer_k = torch.cat((parts[0].keys, parts[1].keys, own_k), dim=1)
        buffer_v = torch.cat((parts[0].values, parts[1].values, own_v), dim=1)
        mask = torch.cat((torch.ones(kv_heads, 11, dtype=torch.bool), parts[1].mask,
                          torch.ones(kv_heads, 1, dtype=torch.bool)), dim=1)
        torch.testing.assert_close(masked_attention(q[0], buffer_k, buffer_v, mask, 0.3), got[0], atol=1e-6, rtol=1e-6)
