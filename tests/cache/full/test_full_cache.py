"""The `full` cache method: memory accounting, budget validation, attention paths."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair, make_runner

from kvforge.cache.attention import decode_attention, reference_attention
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.engine.runner import StepItem
from kvforge.errors import CacheCapacityError, ConfigError

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@pytest.mark.parametrize("storage", sorted(BYTES))
def test_bytes_per_token_formula(storage):
    layers, kv_heads, head_dim = 5, 3, 16
    layout = CacheLayout.one_per_layer([CacheLayerSpec(kv_heads, head_dim, 0.25)] * layers)
    cache = create_cache(f"full:storage_dtype={storage}", layout, 1 << 24, torch.float32)
    expected = 2 * layers * kv_heads * head_dim * BYTES[storage]
    assert cache.memory.kv_bytes_per_token() == expected
    # a whole number of pages: exactly the formula per token
    assert cache.memory.sequence_bytes(16 * 7) == expected * 16 * 7


def test_sliding_layers_bounded_by_window():
    window, block = 64, 16
    specs = [CacheLayerSpec(1, 32, 1.0, window if i % 3 else None) for i in range(6)]
    cache = create_cache(f"full:block_size={block}", CacheLayout.one_per_layer(specs), 1 << 24, torch.float32)
    per_layer = 2 * 1 * 32 * 4
    for tokens in (10, 64, 1000, 5000):
        global_bytes = 2 * per_layer * -(-tokens // block) * block
        sliding_bound = 4 * per_layer * (-(-(window - 1) // block) + 1) * block
        assert cache.memory.sequence_bytes(tokens) <= global_bytes + sliding_bound
    assert cache.memory.sequence_bytes(5000) - cache.memory.sequence_bytes(1000) == 2 * per_layer * 4000


def test_budget_too_small_for_one_block():
    layout = CacheLayout.one_per_layer([CacheLayerSpec(2, 64, 0.125)] * 4)
    with pytest.raises(ConfigError, match="kv_budget.*at least one block"):
        create_cache("full", layout, 1000, torch.float32)


def test_bad_cache_specs():
    with pytest.raises(ConfigError, match="known cache methods"):
        parse_cache_spec("nope")
    with pytest.raises(ConfigError, match="storage_dtype"):
        parse_cache_spec("full:storage_dtype=int3")
    with pytest.raises(ConfigError, match="known options"):
        parse_cache_spec("full", ["colour=blue"])
    assert parse_cache_spec("full", ["block_size=32"]).config().block_size == 32


def test_exhaustion_reported_and_other_sequences_unaffected():
    _, model = make_pair("llama_gqa")
    layout = model.cache_layout()
    page = 2 * 3 * 2 * 16 * 4 * 4  # 2 (K,V) x layers x kv_heads x head_dim x 4 bytes x block 4
    runner = make_runner(model, budget=page * 5)  # 20 tokens in total
    assert layout.num_cache_layers == 3
    runner.step([StepItem(0, list(range(12)))])
    with pytest.raises(CacheCapacityError, match="budget exhausted"):
        runner.step([StepItem(1, list(range(12)))])
    assert runner.cache.num_cached_tokens(1) == 0
    runner.step([StepItem(0, [5])])  # the first sequence goes on
    assert runner.cache.num_cached_tokens(0) == 13


@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_matches_reference(window):
    torch.manual_seed(0)
    heads, kv_heads, dim, block, pages_total = 6, 2, 8, 4, 40
    k_pages = torch.randn(kv_heads, pages_total, block, dim)
    v_pages = torch.randn(kv_heads, pages_total, block, dim)
    lengths = [0, 3, 9, 17]  # cached tokens per sequence
    tables = [torch.randperm(pages_total)[:(n + block - 1) // block].tolist() for n in lengths]
    q = torch.randn(len(lengths), heads, dim)
    k_self = torch.randn(len(lengths), kv_heads, dim)
    v_self = torch.randn(len(lengths), kv_heads, dim)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    visible_from = torch.tensor([0 if window is None else max(0, n - window + 1) for n in lengths])
    out = decode_attention(q, k_self, v_self, k_pages, v_pages, table, torch.zeros(4, dtype=torch.long),
                           visible_from, torch.tensor(lengths), scale=0.3, tile_pages=2)
    for b, n in enumerate(lengths):
        keys = torch.cat((k_pages[:, tables[b]].flatten(1, 2)[:, :n].transpose(0, 1), k_self[b:b + 1]))
        values = torch.cat((v_pages[:, tables[b]].flatten(1, 2)[:, :n].transpose(0, 1), v_self[b:b + 1]))
        expected = reference_attention(q[b:b + 1], keys, values, torch.tensor([n]), torch.arange(n + 1),
                                       0.3, window)
        torch.testing.assert_close(out[b:b + 1], expected, atol=1e-5, rtol=0)


def test_decode_attention_ignores_garbage_in_hidden_slots():
    """Never-written slots (torch.empty storage) may hold NaN/inf; hidden slots must not leak."""
    torch.manual_seed(0)
    k_pages = torch.randn(1, 4, 4, 8)
    v_pages = torch.randn(1, 4, 4, 8)
    k_pages[0, 1, 2:] = float("nan")  # beyond the stored length of the sequence
    v_pages[0, 1, 2:] = float("inf")
    v_pages[0, 3] = float("nan")  # a padding page
    out = decode_attention(torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8), k_pages,
                           v_pages, torch.tensor([[0, 1, 3]]), torch.tensor([0]), torch.tensor([0]),
                           torch.tensor([6]), scale=0.3, tile_pages=2)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
def test_low_precision_storage_close_to_fp32(storage):
    hf, model = make_pair("llama_gqa")
    tokens = list(range(3, 40))
    exact = make_runner(model)
    reduced = make_runner(model, cache=f"full:block_size=4,storage_dtype={storage}")
    for runner in (exact, reduced):
        runner.step([StepItem(0, tokens[:20])])
    a = torch.stack([exact.step([StepItem(0, [t])])[0] for t in tokens[20:]])
    b = torch.stack([reduced.step([StepItem(0, [t])])[0] for t in tokens[20:]])
    assert 0 < (a - b).abs().max() < 0.05
    assert reduced.cache.memory_usage()["fast"] * 2 == exact.cache.memory_usage()["fast"]


@pytest.mark.parametrize("decode_first", [True, False])
def test_mixed_prefill_and_decode_step_matches_separate_steps(decode_first):
    """A step holding a decode token and a prompt chunk (continuous batching) gives each the
    logits it gets in a step of its own: the decode-only shortcut (no gather/scatter of rows)
    must not take such a step."""
    _, model = make_pair("llama_gqa")
    prompt0, prompt1, token = list(range(3, 20)), list(range(30, 41)), 7
    alone = make_runner(model)
    alone.step([StepItem(0, prompt0)])
    decode_alone = alone.step([StepItem(0, [token])])[0]
    prefill_alone = alone.step([StepItem(1, prompt1)])[0]
    mixed = make_runner(model)
    mixed.step([StepItem(0, prompt0)])
    items = [StepItem(0, [token]), StepItem(1, prompt1)]
    out = mixed.step(items if decode_first else items[::-1])
    decode_mixed, prefill_mixed = (out[0], out[1]) if decode_first else (out[1], out[0])
    torch.testing.assert_close(decode_mixed, decode_alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(prefill_mixed, prefill_alone, atol=1e-5, rtol=0)
