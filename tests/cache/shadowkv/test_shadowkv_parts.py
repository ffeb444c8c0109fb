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
from kvforge.rope import RotaryEmbedding


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
    layer, data = compress_layer(keys_post, values, rope, prefix, lambda _: heads * dim, chunk, 2, window_capacity=12,
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


def test_compress_layer_at_low_rank_follows_its_definition():
    """Lossy settings pinned to the paper's definition: the basis spans the top-r right
    singular vectors of the *pre*-RoPE keys (so its reconstruction error is the
    Eckart-Young optimum), landmarks are chunk means of the *post*-RoPE keys, and the
    outliers are the chunks with the lowest min cosine to their landmark."""
    torch.manual_seed(5)
    heads, n, dim, chunk, rank, outliers = 2, 48, 8, 4, 3, 2
    rope = _rope(dim)
    width = heads * dim
    keys_pre = (torch.randn(n, rank) @ torch.randn(rank, width) + 0.05 * torch.randn(n, width)).view(n, heads, dim)
    keys_post = rope.apply_at(keys_pre, torch.arange(n)).transpose(0, 1)  # [H, n, D]
    values = torch.randn(heads, n, dim)
    prefix = 40
    layer, data = compress_layer(keys_post, values, rope, prefix, lambda _: rank, chunk, outliers, window_capacity=12,
                                 chunks_per_step=2)
    # basis: the projector onto the top-r right singular vectors of the pre-RoPE keys
    flat_pre = keys_pre.reshape(n, width).double()
    _, _, vh = torch.linalg.svd(flat_pre, full_matrices=False)
    expected = vh[:rank].T @ vh[:rank]
    torch.testing.assert_close((layer.basis.T @ layer.basis).double(), expected, atol=1e-4, rtol=0)
    # its reconstruction of the prefix is the optimal rank-r one
    rebuilt = data.coefficients.reshape(prefix, rank).double() @ layer.basis.double()
    optimal = flat_pre[:prefix] @ expected
    torch.testing.assert_close(rebuilt, optimal, atol=1e-4, rtol=0)
    # a basis taken from the post-RoPE keys would be far worse (RoPE spreads the rank)
    post_basis = key_basis(keys_post.transpose(0, 1).reshape(n, width), rank).double()
    post_error = (flat_pre - flat_pre @ post_basis.T @ post_basis).norm()
    assert (flat_pre - flat_pre @ expected).norm() < 0.3 * post_error
    # landmarks: chunk means of the post-RoPE prefix keys
    torch.testing.assert_close(data.landmarks, keys_post[:, :prefix].reshape(heads, prefix // chunk, chunk, dim)
                               .mean(dim=2))
    # outliers: per head, the chunks whose keys point furthest from their landmark
    for h in range(heads):
        scores = []
        for c in range(prefix // chunk):
            block = keys_post[h, c * chunk:(c + 1) * chunk]
            mean = block.mean(dim=0)
            scores.append(min(float(torch.dot(k, mean) / (k.norm() * mean.norm())) for k in block))
        lowest = sorted(range(len(scores)), key=scores.__getitem__)[:outliers]
        assert layer.outliers[h].tolist() == sorted(lowest)


def _cache_step(cache, seq: int, cached: int, k_pre, v, q_pre, rope_table, num_logits: int):
    """One step of one sequence straight on the cache (one layer): returns the attention output."""
    from kvforge.batch import ForwardBatch

    count = k_pre.shape[0]
    assert cache.allocate(seq, cached + count)
    batch = ForwardBatch.build([seq], [[0] * count], [cached], [num_logits])
    rope = rope_table.at(batch.positions, torch.float32)
    meta = cache.begin_step(batch)
    cache.write(0, meta, k_pre, v, rope)
    out = cache.attend(0, meta, rope.apply(q_pre), rope)
    cache.end_step(meta)
    return out


def test_a_planted_chunk_is_selected_and_rebuilt_at_low_rank():
    """Lossy ShadowKV end to end (rank 2 of 16, one chunk selected per step): pre-RoPE keys
    of rank 2; one chunk of keys aligned with the query carries the attention. Decode
    must find that chunk through its landmark, rebuild its keys from the rank-2 basis and
    match exact attention; without that chunk the output would be far off."""
    from kvforge.cache.layout import CacheLayerSpec, CacheLayout
    from kvforge.cache.registry import create_cache

    torch.manual_seed(7)
    dim, n, chunk, planted = 16, 64, 4, 6  # planted chunk: positions 24..27
    layout = CacheLayout.one_per_layer([CacheLayerSpec(1, dim, dim ** -0.5)])
    spec = "shadowkv:chunk=4,local=8,outliers=1,min_context=24,generated_window=8,rank=2,budget=4,reuse=false"
    cache = create_cache(spec, layout, 1 << 22, torch.float32)
    rope_table = RotaryEmbedding(dim, RopeConfig(theta=10000.0))
    # two directions in the slowly rotating half of the dimensions (pairs 4..7 and 12..15)
    directions = torch.zeros(2, dim)
    directions[0, [4, 5, 12, 13]] = torch.tensor([0.6, 0.5, 0.4, 0.5])
    directions[1, [6, 7, 14, 15]] = torch.tensor([0.5, -0.5, 0.5, 0.5])
    mix = 0.3 * torch.randn(n, 2)
    mix[planted * chunk:(planted + 1) * chunk] = torch.tensor([[5.0, 0.0], [5.2, 0.0], [5.4, 0.0], [5.6, 0.0]])
    k_pre = (mix @ directions).view(n, 1, dim)
    values = torch.randn(n, 1, dim)
    _cache_step(cache, 0, 0, k_pre, values, torch.zeros(n, 1, dim), rope_table, num_logits=1)
    assert cache.is_compressed(0)
    q_pre = (8.0 * directions[0]).view(1, 1, dim)
    k_new, v_new = torch.zeros(1, 1, dim), torch.randn(1, 1, dim)
    out = _cache_step(cache, 0, n, k_new, v_new, q_pre, rope_table, num_logits=1)

    positions = torch.arange(n + 1)
    rope_all = rope_table.at(positions, torch.float32)
    keys_post = rope_all.apply(torch.cat([k_pre, k_new]))
    vals = torch.cat([values, v_new])
    q_post = rope_table.at(positions[-1:], torch.float32).apply(q_pre)
    exact = reference_attention(q_post, keys_post, vals, positions[-1:], positions, dim ** -0.5, None)
    torch.testing.assert_close(out, exact, atol=5e-3, rtol=0)
    keep = torch.ones(n + 1, dtype=torch.bool)
    keep[planted * chunk:(planted + 1) * chunk] = False
    without = reference_attention(q_post, keys_post[keep], vals[keep], positions[-1:], positions[keep], dim ** -0.5,
                                  None)
    assert (without - exact).abs().max() > 0.3  # the planted chunk is what matters
