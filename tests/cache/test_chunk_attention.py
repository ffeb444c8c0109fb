"""`chunk_attention` (prefill chunks over a dense key range) against the definition,
`reference_attention`, with and without the sliding-window tiling."""

from __future__ import annotations

import pytest
import torch

from kvforge.cache import attention
from kvforge.cache.attention import _window_tiles, chunk_attention, reference_attention


@pytest.mark.parametrize(("n", "past", "window"), [
    (300, 0, None),      # aligned causal prompt
    (300, 0, 512),       # window longer than the chunk: plain causal path
    (700, 0, 64),        # tiled: 700 queries, windows of 64 (tiles of 128)
    (200, 900, 100),     # tiled: a later chunk whose window reaches back into past keys
    (50, 400, 1000),     # window longer than everything: masked path, nothing clipped
    (257, 3, 128),       # tiled, ragged last tile, keys starting 3 before the queries
    (120, 500, None),    # a later chunk, no window: past and own keys apart, merged
    (1, 64, None),       # one query over its past (a chunk of one token)
])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_chunk_attention_matches_the_definition(n, past, window, heads, kv_heads):
    torch.manual_seed(n + past)
    dim, m = 16, past + n
    first_k = 37  # keys start at an arbitrary position; queries are the last n of them
    q = torch.randn(n, heads, dim)
    k = torch.randn(m, kv_heads, dim)
    v = torch.randn(m, kv_heads, dim)
    got = chunk_attention(q, k.transpose(0, 1), v.transpose(0, 1), first_k + past, first_k, 0.25, window)
    q_pos = torch.arange(first_k + past, first_k + m)
    k_pos = torch.arange(first_k, first_k + m)
    want = reference_attention(q, k, v, q_pos, k_pos, 0.25, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_window_tiles_cover_every_query_once_and_only_the_keys_it_can_see():
    n, m, window, first_k, first_q = 1000, 1500, 200, 10, 510
    tiles = _window_tiles(n, m, first_q, first_k, window)
    assert [t[0] for t in tiles] == list(range(0, n, 200)) and sum(t[1] for t in tiles) == n
    for start, count, lo, hi in tiles:
        first, last = first_q + start, first_q + start + count - 1
        # keys lo..hi-1 are exactly the union of what the tile's queries see
        assert first_k + lo == max(first_k, first - window + 1) and first_k + hi == last + 1
        assert hi - lo <= count + window - 1


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_later_chunk_without_a_window_builds_no_mask(dtype, atol, monkeypatch):
    """On the CPU a later chunk's queries attend the past keys and their own apart (flash
    kernel, no mask), merged by log-sum-exp: the definition, without the [n, m] mask."""
    monkeypatch.setattr(attention, "_masked_attention", lambda *a: pytest.fail("the masked path ran"))
    torch.manual_seed(0)
    n, past, heads, kv_heads, dim = 96, 160, 6, 2, 16
    q = torch.randn(n, heads, dim, dtype=dtype)
    k = torch.randn(past + n, kv_heads, dim, dtype=dtype)
    v = torch.randn(past + n, kv_heads, dim, dtype=dtype)
    got = chunk_attention(q, k.transpose(0, 1), v.transpose(0, 1), past, 0, 0.25, None)
    positions = torch.arange(past + n)
    want = reference_attention(q, k, v, positions[past:], positions, 0.25, None)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize(("n", "past", "window"), [
    (300, 0, None),      # aligned causal prompt: the kernel
    (120, 500, None),    # a later chunk: the kernel, past and own keys in one pass
    (50, 400, 1000),     # a window longer than every key range: the kernel
    (50, 400, 300),      # a window shorter than the keys but untiled: masked SDPA, not the kernel
    (700, 0, 64),        # tiled windows: masked SDPA per tile
])
def test_bf16_chunks_take_the_causal_kernel_exactly_where_every_earlier_key_is_visible(n, past, window,
                                                                                       monkeypatch):
    from kvforge.kernels.cpu_causal_attention import causal_attention_available

    calls = []
    kernel = attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *args: calls.append(args) or kernel(*args))
    torch.manual_seed(n + past)
    heads, kv_heads, dim, m = 9, 3, 64, past + n
    q = torch.randn(n, heads, dim).bfloat16()
    k = torch.randn(m, kv_heads, dim).bfloat16()
    v = torch.randn(m, kv_heads, dim).bfloat16()
    got = chunk_attention(q, k.transpose(0, 1), v.transpose(0, 1), past, 0, 0.125, window)
    positions = torch.arange(m)
    want = reference_attention(q.float(), k.float(), v.float(), positions[past:], positions, 0.125, window)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert bool(calls) == (window is None or window >= m)
    if calls and causal_attention_available():
        assert torch.equal(got, kernel(*calls[0])[0])


@pytest.mark.parametrize(("n", "past"), [(300, 0), (120, 500)])
def test_float32_chunks_take_the_causal_kernel(n, past, monkeypatch):
    """A whole float32 prompt and a later chunk with every earlier key visible: the kernel's
    float32 result, as close to the definition as ATen's."""
    from kvforge.kernels.cpu_causal_attention import causal_attention_available

    if not causal_attention_available(torch.float32):
        pytest.skip("needs the C++ kernel on a CPU with AVX-512F")
    calls = []
    kernel = attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *args: calls.append(args) or kernel(*args))
    torch.manual_seed(n + past)
    heads, kv_heads, dim, m = 9, 3, 64, past + n
    q, k, v = torch.randn(n, heads, dim), torch.randn(m, kv_heads, dim), torch.randn(m, kv_heads, dim)
    got = chunk_attention(q, k.transpose(0, 1), v.transpose(0, 1), past, 0, 0.125, None)
    positions = torch.arange(m)
    want = reference_attention(q, k, v, positions[past:], positions, 0.125, None)
    assert got.dtype == torch.float32 and len(calls) == 1
    assert torch.equal(got, kernel(*calls[0])[0])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
