"""A KIVI step's writes (cache/kivi/step_writes.py): the C++ ops (`cpu_quant.flush_value_tokens`,
`cpu_quant.write_ring_rows`) leave the store byte for byte as the PyTorch expressions they
replace, over prompts, decode steps and mixed steps, with every layer's K/V different."""

from __future__ import annotations

import pytest
import torch
from kivi_helpers import identity_rope, step_batch

from kvforge.cache.kivi import cpu_quant, step_writes
from kvforge.cache.kivi.method import KIVICache
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache

requires_kernel = pytest.mark.skipif(not cpu_quant.quantize_kernel_available(),
                                     reason="the KIVI quantisation kernel did not build here")

KV_HEADS, DIM, LAYERS = 2, 32, 3
STORE_TENSORS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_res", "v_res")


def make_cache(options: str, model_dtype: torch.dtype) -> KIVICache:
    specs = [CacheLayerSpec(KV_HEADS, DIM, DIM ** -0.5)] * LAYERS
    cache = create_cache(f"kivi:group=8,residual=16,decode_kernel=torch,{options}", CacheLayout.one_per_layer(specs),
                         1 << 22, model_dtype)
    assert isinstance(cache, KIVICache)
    # Every byte compared below is one the steps wrote or the same garbage in both caches.
    for name in STORE_TENSORS:
        getattr(cache.store, name).zero_()
    return cache


def drive(cache: KIVICache, model_dtype: torch.dtype, seed: int) -> None:
    """Prompts of different lengths (one longer than the residual), then decode steps, one of
    them mixed with a new prompt's chunk; layer l's K/V differ from every other layer's."""
    generator = torch.Generator().manual_seed(seed)
    plan = [{0: 21, 1: 5}, {0: 1, 1: 1}] + [{0: 1, 1: 1}] * 14 + [{0: 1, 1: 1, 2: 30}] + [{0: 1, 1: 1, 2: 1}] * 12
    for step in plan:
        batch, _ = step_batch(cache, step)
        rows = sum(step.values())
        rope = identity_rope(rows, DIM, model_dtype)
        meta = cache.begin_step(batch)
        for layer in range(LAYERS):
            k = (torch.randn(rows, KV_HEADS, DIM, generator=generator) * (layer + 1)).to(model_dtype)
            v = (torch.randn(rows, KV_HEADS, DIM, generator=generator) - layer).to(model_dtype)
            cache.write(layer, meta, k, v, rope)
        cache.end_step(meta)


def assert_same_store(a: KIVICache, b: KIVICache) -> None:
    for name in STORE_TENSORS:
        x, y = getattr(a.store, name), getattr(b.store, name)
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{name} differs"


@requires_kernel
@pytest.mark.parametrize(("options", "model_dtype"), [
    ("bits=2", torch.float32),
    ("bits=4,residual_dtype=bfloat16", torch.bfloat16),
    ("bits=2,value_group=16,residual_dtype=float16", torch.bfloat16),
    ("bits=4,value_bits=2,sinks=2", torch.float32),
    ("bits=8,residual_dtype=bfloat16", torch.float32),
])
def test_the_ops_write_what_the_pytorch_expressions_write(monkeypatch, options, model_dtype):
    calls = {"flush": 0, "ring": 0}
    flush, ring = step_writes.flush_value_tokens, step_writes.write_ring_rows

    def counted_flush(*args):
        wrote = flush(*args)
        calls["flush"] += wrote
        return wrote

    def counted_ring(*args):
        wrote = ring(*args)
        calls["ring"] += wrote
        return wrote

    fast = make_cache(options, model_dtype)
    monkeypatch.setattr(step_writes, "flush_value_tokens", counted_flush)
    monkeypatch.setattr(step_writes, "write_ring_rows", counted_ring)
    drive(fast, model_dtype, seed=5)
    assert calls["flush"] > 10 and calls["ring"] > 20, "the decode steps must take the ops (and they write)"
    monkeypatch.setattr(step_writes, "flush_value_tokens", lambda *args: False)
    monkeypatch.setattr(step_writes, "write_ring_rows", lambda *args: False)
    reference = make_cache(options, model_dtype)
    drive(reference, model_dtype, seed=5)
    assert_same_store(fast, reference)


@requires_kernel
def test_the_ops_place_each_layer_and_token():
    """Against their definitions directly: a ring row quantised into its page slot, a step row
    written at its (layer, slot, offset), nothing else touched."""
    from kvforge.cache.kivi.quant import quantize_reference

    generator = torch.Generator().manual_seed(1)
    v_res = torch.randn(4, 3, KV_HEADS, 16, DIM, generator=generator).bfloat16()
    codes = torch.zeros(2, KV_HEADS, 5, 8, DIM * 2 // 8, dtype=torch.uint8)
    scale, zero = torch.zeros(2, KV_HEADS, 5, 8, DIM // 16, dtype=torch.float16), torch.zeros(2, KV_HEADS, 5, 8, DIM // 16, dtype=torch.float16)
    layers, slots, offsets = torch.tensor([3, 1]), torch.tensor([2, 0]), torch.tensor([7, 15])
    order, flat = torch.tensor([1, 0]), torch.tensor([33, 4])
    assert cpu_quant.flush_value_tokens(v_res, layers, slots, offsets, order, codes, scale, zero, flat, 2, 16)
    for j, layer in enumerate(layers.tolist()):
        for i, e in enumerate(order.tolist()):
            expected = quantize_reference(v_res[layer, slots[e], :, offsets[e]], 2, 16)
            page, at = divmod(int(flat[i]), 8)
            assert torch.equal(codes[j, :, page, at], expected.packed)
            assert torch.equal(scale[j, :, page, at], expected.scale) and torch.equal(zero[j, :, page, at], expected.zero)
    assert int(codes.count_nonzero(dim=-1).bool().sum()) <= 2 * 2 * KV_HEADS  # only those slots written

    ring = torch.zeros(4, 3, KV_HEADS, 16, DIM, dtype=torch.float16)
    rows = [torch.randn(5, KV_HEADS, DIM, generator=generator) for _ in range(2)]
    src, slots, offsets = torch.tensor([4, 0]), torch.tensor([1, 2]), torch.tensor([3, 9])
    assert cpu_quant.write_ring_rows(ring, layers, rows, src, slots, offsets)
    expected = torch.zeros_like(ring)
    for j, layer in enumerate(layers.tolist()):
        for i in range(2):
            expected[layer, slots[i], :, offsets[i]] = rows[j][src[i]].half()
    assert torch.equal(ring, expected)


@requires_kernel
def test_the_ops_refuse_bad_indices_and_shapes():
    ring = torch.zeros(2, 3, KV_HEADS, 16, DIM)
    rows = [torch.randn(4, KV_HEADS, DIM)] * 2
    index = torch.tensor([0, 1])
    op = torch.ops.kvforge_kivi_quant.write_ring_rows
    with pytest.raises(RuntimeError, match="offsets entry 16 out of range"):
        op(ring, index, rows, index, index, torch.tensor([0, 16]))
    with pytest.raises(RuntimeError, match="src entry 4 out of range"):
        op(ring, index, rows, torch.tensor([0, 4]), index, index)
    with pytest.raises(RuntimeError, match="one rows tensor per layer"):
        op(ring, index, rows[:1], index, index, index)
    codes = torch.zeros(2, KV_HEADS, 5, 8, DIM // 4, dtype=torch.uint8)
    params = torch.zeros(2, KV_HEADS, 5, 8, DIM // 16, dtype=torch.float16)
    flush = torch.ops.kvforge_kivi_quant.flush_value_tokens
    with pytest.raises(RuntimeError, match="flat_slots entry 40 out of range"):
        flush(ring, index, index, index, index, codes, params, params.clone(), torch.tensor([0, 40]), 2, 16)
    with pytest.raises(RuntimeError, match="must be \\[layers, H, P, G, D \\* bits / 8\\]"):
        flush(ring, index, index, index, index, codes, params, params.clone(), index, 4, 16)
    # Not eligible (another dtype of index): the wrappers write nothing and say so.
    assert not cpu_quant.write_ring_rows(ring, index.int(), rows, index, index, index)
