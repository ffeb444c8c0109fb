"""The `kivi` cache method: residual rules, stored contents, attention against the reference
over the dequantised K/V, memory accounting, config validation, and models end to end."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner
from kivi_helpers import run_step, stored_kv

from kvforge.cache.attention import reference_attention
from kvforge.cache.kivi.method import KIVICache
from kvforge.cache.kivi.quant import dequantize, quantize, quantized_bits_per_element
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError

HEADS, KV_HEADS, DIM, G, R = 6, 2, 16, 8, 32


def make_cache(bits: int = 2, window: int | None = None, layers: int = 1, budget: int = 1 << 22,
               residual_dtype: str = "float32", decode_kernel: str = "torch", tile: int = 16) -> KIVICache:
    specs = [CacheLayerSpec(KV_HEADS, DIM, DIM ** -0.5, window if i % 2 else None) for i in range(layers)] \
        if window is not None else [CacheLayerSpec(KV_HEADS, DIM, DIM ** -0.5)] * layers
    spec = (f"kivi:bits={bits},group={G},residual={R},residual_dtype={residual_dtype},"
            f"decode_kernel={decode_kernel},prefill_tile_tokens={tile},decode_tile_tokens={tile}")
    cache = create_cache(spec, CacheLayout.one_per_layer(specs), budget, torch.float32)
    assert isinstance(cache, KIVICache)
    return cache


def expected_storage(keys: torch.Tensor, values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the residual rules say a sequence holding these exact K/V [n, H, D] stores."""
    n = keys.shape[0]
    nk, nv = (n // R) * R, max(0, n - R)
    k, v = keys.clone(), values.clone()
    if nk:  # per channel over pages of G tokens
        pages = keys[:nk].reshape(nk // G, G, KV_HEADS, DIM).permute(0, 2, 3, 1)
        k[:nk] = dequantize(quantize(pages, bits, G)).permute(0, 3, 1, 2).reshape(nk, KV_HEADS, DIM)
    if nv:  # per token over groups of G channels
        v[:nv] = dequantize(quantize(values[:nv], bits, G))
    return k, v


def test_residual_rules_over_1000_tokens():
    """After every step (chunks of several sizes and single tokens), keys of [0, nk) and values
    of [0, nv) are the quantised exact tokens and the rest is exact, nk = (n // R) * R,
    nv = max(0, n - R); quantised pages are held only for [0, nk)."""
    torch.manual_seed(0)
    cache = make_cache(bits=2, tile=1024)  # attention is checked elsewhere: few tiles, fast
    total = 1000
    keys, values = torch.randn(total, KV_HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
    sizes = [1, 7, 1, 1, 40, 1, 33, 95, 1, 1, 1, 64, 3, 130]
    n, step = 0, 0
    while n < total:
        size = min(sizes[step] if step < len(sizes) else (20 if step % 5 == 0 else 1), total - n)
        step += 1
        q = torch.randn(size, HEADS, DIM)
        run_step(cache, {0: (q, keys[n:n + size], values[n:n + size])}, [0])
        n += size
        got_k, got_v, start = stored_kv(cache, 0, 0)
        want_k, want_v = expected_storage(keys[:n], values[:n], 2)
        assert start == 0 and cache.num_cached_tokens(0) == n
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
        torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)
        nk = (n // R) * R
        assert len(cache.pages.pages(0, 0)) == nk // G
        assert cache.memory_usage()["fast"] == (nk // G + cache.slot_pages) * cache.page_bytes
    assert step > 100  # many single-token steps after the mixed chunks


def test_storage_does_not_depend_on_chunking():
    torch.manual_seed(1)
    keys, values = torch.randn(300, KV_HEADS, DIM), torch.randn(300, KV_HEADS, DIM)
    one, many = make_cache(bits=4), make_cache(bits=4)
    run_step(one, {0: (torch.randn(300, HEADS, DIM), keys, values)}, [0])
    n = 0
    for size in (5, 100, 1, 1, 60, 133):
        run_step(many, {0: (torch.randn(size, HEADS, DIM), keys[n:n + size], values[n:n + size])}, [0])
        n += size
    for a, b in zip(stored_kv(one, 0, 0)[:2], stored_kv(many, 0, 0)[:2]):
        assert torch.equal(a, b)


def reference_output(cache: KIVICache, work: dict, window: int | None, layer: int) -> dict[int, torch.Tensor]:
    """reference_attention over what the cache stores before the step + the step's exact K/V."""
    out = {}
    for seq, (q, k, v) in work.items():
        n = cache.num_cached_tokens(seq)
        if n:
            past_k, past_v, start = stored_kv(cache, seq, layer)
        else:
            past_k, past_v, start = torch.empty(0, KV_HEADS, DIM), torch.empty(0, KV_HEADS, DIM), 0
        keys, vals = torch.cat((past_k, k)), torch.cat((past_v, v))
        q_pos = torch.arange(n, n + q.shape[0])
        out[seq] = reference_attention(q, keys, vals, q_pos, torch.arange(start, n + q.shape[0]), DIM ** -0.5,
                                       window)
    return out


def random_work(lengths: dict[int, int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return {s: (torch.randn(m, HEADS, DIM), torch.randn(m, KV_HEADS, DIM) * 2, torch.randn(m, KV_HEADS, DIM))
            for s, m in lengths.items()}


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("window", [None, 20])
def test_attention_equals_reference_over_dequantised_kv(bits, window):
    """Prefill chunks, decode batches and mixed batches, GQA (6 query heads on 2 KV heads),
    a sliding-window layer beside a global one: 1e-5 in fp32."""
    torch.manual_seed(2)
    cache = make_cache(bits=bits, window=window, layers=2)
    layer = 1 if window is not None else 0  # the sliding layer when there is one
    schedule = [{0: 50, 1: 9}, {0: 1, 1: 1}, {0: 1, 1: 30, 2: 70}, {0: 1, 1: 1, 2: 1}]
    schedule += [{0: 1, 1: 1, 2: 1}] * 25 + [{0: 45, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]
    checked = 0
    for lengths in schedule:
        work = random_work(lengths)
        expected = reference_output(cache, work, window, layer)
        got = run_step(cache, work, [0, 1][:layer + 1] if window is not None else [0])
        for seq in work:
            torch.testing.assert_close(got[seq], expected[seq], rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked > 80
    # every sequence went past a key flush and a value-window slide during the schedule
    assert min(cache.num_cached_tokens(s) for s in range(3)) > 2 * R


def test_attention_is_not_exact_attention():
    """The quantised tokens matter (2-bit output differs from exact attention), so the
    parity above is not vacuous."""
    torch.manual_seed(3)
    cache = make_cache(bits=2)
    work = random_work({0: 200})
    run_step(cache, work, [0])
    q, k, v = (torch.randn(1, HEADS, DIM), torch.randn(1, KV_HEADS, DIM), torch.randn(1, KV_HEADS, DIM))
    got = run_step(cache, {0: (q, k, v)}, [0])[0]
    keys, vals = torch.cat((work[0][1], k)), torch.cat((work[0][2], v))
    exact = reference_attention(q, keys, vals, torch.tensor([200]), torch.arange(201), DIM ** -0.5, None)
    assert (got - exact).abs().max() > 1e-3


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bytes_per_token_within_5_percent_of_analytic(bits):
    layers = 5
    layout = CacheLayout.one_per_layer([CacheLayerSpec(3, 64, 0.125)] * layers)
    cache = create_cache(f"kivi:bits={bits}", layout, 1 << 26, torch.float32)
    analytic = 2 * layers * 3 * 64 * quantized_bits_per_element(bits, 32) / 8
    assert abs(cache.memory.kv_bytes_per_token() / analytic - 1) <= 0.05
    # The marginal cost of a stored token in sequence_bytes is the same quantised rate.
    marginal = (cache.memory.sequence_bytes(128 * 20) - cache.memory.sequence_bytes(128 * 4)) / (128 * 16)
    assert abs(marginal / analytic - 1) <= 0.05
    if bits == 2:
        assert abs(cache.memory.kv_bytes_per_token() / (2 * layers * 3 * 64 * 2) - 0.1875) < 1e-9


def test_residual_counts_against_the_budget():
    """A sequence's full-precision residual (K and V, R tokens, every layer) is paid from the
    same pool as the pages; the number of sequences admitted follows sequence_bytes."""
    cache = make_cache(bits=2, layers=3, budget=1 << 20)
    residual = 2 * 3 * KV_HEADS * R * DIM * 4
    assert cache.slot_pages * cache.page_bytes >= residual
    assert cache.slot_pages * cache.page_bytes < residual + cache.page_bytes
    assert cache.memory.sequence_bytes(1) == cache.slot_pages * cache.page_bytes
    tokens = 200
    admitted = 0
    while cache.allocate(admitted, tokens):
        admitted += 1
    capacity = cache.memory.capacity["fast"]
    # The budget is split once between residual slots and pages: whichever runs out first
    # bounds the admitted sequences, never more than the bytes alone allow.
    pages_each = cache.pages.max_pages_per_sequence(cache.quantized_keys(tokens))
    assert admitted == min(cache.num_slots, cache.pages.pool.num_blocks // pages_each) >= 2
    assert admitted <= capacity // cache.memory.sequence_bytes(tokens)
    assert cache.memory_usage()["fast"] == admitted * cache.memory.sequence_bytes(tokens)
    for seq in range(admitted):
        cache.free(seq)
    assert cache.memory_usage()["fast"] == 0 and cache.allocate(0, tokens)


def test_bad_configs_fail_with_clear_messages():
    with pytest.raises(ConfigError, match="bits.*3.*must be one of"):
        parse_cache_spec("kivi:bits=3")
    with pytest.raises(ConfigError, match="residual.*100.*multiple of group=32"):
        parse_cache_spec("kivi:residual=100")
    with pytest.raises(ConfigError, match="residual.*16.*>= group=32"):
        parse_cache_spec("kivi:residual=16")
    layout = CacheLayout.one_per_layer([CacheLayerSpec(2, 48, 0.1)])
    with pytest.raises(ConfigError, match="group.*32.*divide head_dim=48"):
        create_cache("kivi", layout, 1 << 24, torch.float32)
    with pytest.raises(ConfigError, match="kv_budget"):
        create_cache("kivi:group=16", layout, 10_000, torch.float32)


def test_unallocated_sequence_is_refused():
    cache = make_cache()
    from kvforge.batch import ForwardBatch

    with pytest.raises(ConfigError, match="allocate"):
        cache.begin_step(ForwardBatch.build([7], [[1, 2]], [0]))


# -- models end to end -------------------------------------------------------------------
KIVI8 = "kivi:bits=8,group=8,residual=16"  # decode: the CPU kernel when it builds


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3_hybrid"])
def test_8bit_decode_matches_full_cache(arch):
    """Many decode steps past the sliding window (gemma3_hybrid: window 10) and past several
    residual flushes: 8-bit KIVI logits stay close to the full cache's."""
    _, model = make_pair(arch)
    prompts = [list(range(3, 40)), list(range(5, 12)), list(range(1, 60))]
    full = decode_logits(make_runner(model), prompts, 40)
    kivi = decode_logits(make_runner(model, cache=KIVI8), prompts, 40)
    assert torch.isfinite(kivi).all()
    assert (full - kivi).abs().max() < 0.02 * full.abs().max()
    two_bit = decode_logits(make_runner(model, cache=KIVI8.replace("bits=8", "bits=2")), prompts, 40)
    assert (full - two_bit).abs().max() > (full - kivi).abs().max()  # fewer bits, larger error


def test_engine_generates_under_a_tight_budget():
    """LLMEngine with the kivi cache: requests admitted as the pool allows, preempted and
    recomputed when it runs out, all finished with their max_tokens."""
    _, model = make_pair("llama_gqa")
    cache = create_cache(KIVI8, model.cache_layout(), 60_000, torch.float32)
    engine = LLMEngine(model, cache, None, EngineConfig(kv_budget_bytes=60_000, max_num_batched_tokens=64))
    params = SamplingParams.greedy_params(max_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request(list(range(1 + i, 30 + i)), params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert len(finished) == 4 and all(len(o.token_ids) == 30 and o.error is None for o in finished)
    engine.clear_prefix_cache()  # finished sequences are kept for continuation until then
    assert cache.memory_usage()["fast"] == 0


@pytest.mark.parametrize("cache_spec", ["full:block_size=8", KIVI8 + ",max_sequences=9"])  # pages bind first
def test_reserve_admission_never_preempts(cache_spec):
    """EngineConfig(admission="reserve") admits a request only when the lifetime bytes of the
    running ones and its own fit: under the same tight budget the optimistic policy preempts
    and the reserving one does not, and both finish every request."""
    _, model = make_pair("llama_gqa")
    results = {}
    for admission in ("optimistic", "reserve"):
        cache = create_cache(cache_spec, model.cache_layout(), 130_000, torch.float32)
        engine = LLMEngine(model, cache, None, EngineConfig(kv_budget_bytes=130_000, max_num_batched_tokens=256,
                                                            admission=admission))
        params = SamplingParams.greedy_params(max_tokens=40, ignore_eos=True)
        for i in range(6):
            engine.add_request(list(range(1 + i, 40 + i)), params)
        done = 0
        while engine.has_unfinished_requests():
            done += sum(o.finished for o in engine.step())
        assert done == 6
        results[admission] = (engine.scheduler.num_preemptions, engine.scheduler.peak_running)
    assert results["optimistic"][0] > 0 and results["reserve"][0] == 0
    assert results["reserve"][1] >= 2  # still batches what fits
