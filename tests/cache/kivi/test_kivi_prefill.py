"""The blockwise prefill attention of `kivi` (cache/kivi/prefill.py) against the plain PyTorch
reference path (attention.kivi_chunk_attention) and against reference attention over
the dequantised K/V: GQA, several prefill chunks in one step, chunks that straddle the
residual boundary, an empty stored part, sliding windows, every bit width, 1e-5 in fp32."""

from __future__ import annotations

import math

import pytest
import torch
from kivi_helpers import run_step, stored_kv

from kvforge.cache.attention import LseMerge, reference_attention
from kvforge.cache.kivi import prefill as kivi_prefill
from kvforge.cache.kivi.method import KIVICache
from kvforge.cache.kivi.prefill import attention_with_lse, kivi_chunk_attention_fast
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache

HEADS, KV_HEADS, DIM, G, R = 6, 2, 16, 8, 32
SCALE = DIM ** -0.5


def make_cache(prefill: str, bits: int, window: int | None, residual_dtype: str) -> KIVICache:
    specs = [CacheLayerSpec(KV_HEADS, DIM, SCALE, window if i % 2 else None) for i in range(2)]
    spec = (f"kivi:bits={bits},group={G},residual={R},residual_dtype={residual_dtype},decode_kernel=torch,"
            f"prefill_attention={prefill},prefill_tile_tokens=16,decode_tile_tokens=16")
    cache = create_cache(spec, CacheLayout.one_per_layer(specs), 1 << 22, torch.float32)
    assert isinstance(cache, KIVICache)
    return cache


def dequantised_reference(cache: KIVICache, work: dict, window: int | None, layer: int) -> dict[int, torch.Tensor]:
    """reference_attention over the dequantised stored K/V plus the step's exact K/V."""
    out = {}
    for seq, (q, k, v) in work.items():
        n = cache.num_cached_tokens(seq)
        past_k, past_v, start = stored_kv(cache, seq, layer) if n else \
            (torch.empty(0, KV_HEADS, DIM), torch.empty(0, KV_HEADS, DIM), 0)
        # residual_dtype=float16 rounds the stored residual: so does the reference's input
        out[seq] = reference_attention(q, torch.cat((past_k, k)), torch.cat((past_v, v)),
                                       torch.arange(n, n + q.shape[0]), torch.arange(start, n + q.shape[0]),
                                       SCALE, window)
    return out


# Chunk sizes per step (R = 32, G = 8). Step 1: empty stored parts. Later steps cross key
# flushes (cached 50 -> 80 crosses 64) and value-window slides, end exactly on a residual
# boundary (9 -> 32), start on one (32 -> 96), and mix decode tokens with several chunks.
SCHEDULE = [{0: 50, 1: 9, 2: 1}, {0: 30, 1: 23, 2: 5}, {0: 1, 1: 1, 2: 1}, {0: 17, 1: 64, 2: 1},
            {0: 1, 1: 1, 2: 90}, {0: 2, 1: 40, 2: 33}, {0: 100, 1: 1, 2: 3}]


@pytest.mark.parametrize(("bits", "window", "residual_dtype"),
                         [(2, None, "float32"), (4, None, "float32"), (8, None, "float16"), (2, 20, "float32"),
                          (4, 20, "float16"), (8, 20, "float32")])
def test_blockwise_prefill_matches_reference_paths(bits, window, residual_dtype):
    torch.manual_seed(bits + (window or 0))
    fast = make_cache("blockwise", bits, window, residual_dtype)
    slow = make_cache("reference", bits, window, residual_dtype)
    layer = 1 if window is not None else 0  # the sliding layer when there is one
    layers = [0, 1][:layer + 1]
    chunks = 0
    for lengths in SCHEDULE:
        work = {s: (torch.randn(m, HEADS, DIM), torch.randn(m, KV_HEADS, DIM) * 2, torch.randn(m, KV_HEADS, DIM))
                for s, m in lengths.items()}
        expected = dequantised_reference(fast, work, window, layer)
        got = run_step(fast, work, layers)
        reference_path = run_step(slow, work, layers)
        for seq in work:
            torch.testing.assert_close(got[seq], reference_path[seq], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[seq], expected[seq], rtol=1e-5, atol=1e-5)
            chunks += work[seq][0].shape[0] > 1
    assert chunks >= 12
    assert min(fast.num_cached_tokens(s) for s in range(3)) > 3 * R


def test_blockwise_with_the_plain_fallback(monkeypatch):
    """Without ATen's CPU flash operator (other devices) the plain float32 path is used."""
    monkeypatch.setattr(kivi_prefill, "_FLASH_CPU", None)
    test_blockwise_prefill_matches_reference_paths(2, 20, "float32")


def test_empty_stored_part_is_causal_attention():
    torch.manual_seed(5)
    cache = make_cache("blockwise", 2, None, "float32")
    view = cache.store.layer(0, 0)
    q, k, v = torch.randn(40, HEADS, DIM), torch.randn(40, KV_HEADS, DIM), torch.randn(40, KV_HEADS, DIM)
    got = kivi_chunk_attention_fast(q, k, v, view, torch.empty(0, dtype=torch.long), 0, 0, 0, 0, SCALE, None, 2)
    positions = torch.arange(40)
    torch.testing.assert_close(got, reference_attention(q, k, v, positions, positions, SCALE, None),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flash", [True, False])
def test_attention_with_lse(monkeypatch, flash):
    if not flash:
        monkeypatch.setattr(kivi_prefill, "_FLASH_CPU", None)
    torch.manual_seed(6)
    q, k, v = torch.randn(3, 7, DIM), torch.randn(3, 11, DIM), torch.randn(3, 11, DIM)
    visible = torch.rand(7, 11) > 0.4
    visible[2] = False  # a row that sees nothing
    visible[3] = True
    scores = torch.einsum("hnd,hmd->hnm", q, k) * SCALE
    for mask, causal, kk, vv in ((None, False, k, v), (visible, False, k, v),
                                 (None, True, k[:, :7], v[:, :7])):
        out, lse = attention_with_lse(q, kk, vv, SCALE, causal=causal, visible=mask)
        s = scores[..., :kk.shape[1]]
        if causal:
            s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), -math.inf)
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf)
        want_lse = torch.logsumexp(s, dim=-1)
        want = torch.nan_to_num(torch.softmax(s, dim=-1)) @ vv
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    out, lse = attention_with_lse(q, k, v, SCALE, visible=visible)
    assert torch.isneginf(lse[:, 2]).all() and (out[:, 2] == 0).all()  # the row that sees nothing


def test_lse_merge_equals_attention_over_the_union():
    torch.manual_seed(7)
    q, k, v = torch.randn(2, 5, DIM), torch.randn(2, 30, DIM), torch.randn(2, 30, DIM)
    whole, whole_lse = attention_with_lse(q, k, v, SCALE)
    merge = LseMerge(*attention_with_lse(q, k[:, :10], v[:, :10], SCALE))
    merge.add(*attention_with_lse(q, k[:, 10:], v[:, 10:], SCALE))
    hidden = torch.zeros(5, 3, dtype=torch.bool)  # a part no row sees adds nothing
    merge.add(*attention_with_lse(q, k[:, :3], v[:, :3], SCALE, visible=hidden))
    torch.testing.assert_close(merge.out, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merge.lse, whole_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 128])
def test_bf16_chunks_attend_their_own_keys_through_the_causal_kernel(monkeypatch, window):
    """bf16, head dim 64: each chunk's own part goes through kernels/cpu_causal_attention,
    within bf16 rounding of the float32 reference path over the same storage. Without a
    window a later chunk's stored tokens go into the same kernel call; with one (128 >= every
    chunk, < the longest sequence) the stored part is walked with its window mask and
    merged by log-sum-exp."""
    from kvforge.kernels.cpu_causal_attention import causal_attention_available

    calls = []
    kernel = kivi_prefill.causal_attention
    def spy(*args):
        calls.append(kernel(*args))
        return calls[-1]

    monkeypatch.setattr(kivi_prefill, "causal_attention", spy)
    dim = 64
    specs = [CacheLayerSpec(KV_HEADS, dim, dim ** -0.5, window)]
    caches = {path: create_cache(f"kivi:bits=2,group={G},residual={R},decode_kernel=torch,prefill_attention={path},"
                                 "prefill_tile_tokens=16,decode_tile_tokens=16",
                                 CacheLayout.one_per_layer(specs), 1 << 24, torch.bfloat16)
              for path in ("blockwise", "reference")}
    torch.manual_seed(11)
    chunks_after_stored = 0
    for lengths in SCHEDULE:
        work = {s: (torch.randn(m, HEADS, dim).bfloat16(), (torch.randn(m, KV_HEADS, dim) * 2).bfloat16(),
                    torch.randn(m, KV_HEADS, dim).bfloat16()) for s, m in lengths.items()}
        stored = {s: caches["blockwise"].num_cached_tokens(s) for s in work}
        got = run_step(caches["blockwise"], work, [0])
        want = run_step(caches["reference"], work, [0])
        for seq in work:
            torch.testing.assert_close(got[seq].float(), want[seq].float(), atol=3e-2, rtol=3e-2)
            chunks_after_stored += work[seq][0].shape[0] > 1 and stored[seq] > 0
    assert chunks_after_stored >= 8
    assert len(calls) == sum(m > 1 for lengths in SCHEDULE for m in lengths.values())
    if not causal_attention_available():
        pytest.skip("the kernel's own path did not run (no AVX512-BF16 or kernels off)")
    assert all(result is not None for result in calls)  # every chunk's own part took the kernel
