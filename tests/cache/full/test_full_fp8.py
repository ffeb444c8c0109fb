"""`full:storage_dtype=float8_e4m3fn|float8_e5m2`: per-token, per-KV-head scaled FP8 pages
(cache/full/fp8.py). The quantisation against its definition, the byte accounting, and
attention through the engine against the same cache holding the dequantised rows in
float32 (the definition of what FP8 storage attends over): prefill chunks, decode, mixed
batches, GQA and sliding-window layers, at 1e-5."""

from __future__ import annotations

import pytest
import torch
from conftest import across_kv_model, make_pair

from kvforge.cache.full.config import FullCacheConfig
from kvforge.cache.full.fp8 import FP8_DTYPES, dequantize, quantize_per_token
from kvforge.cache.full.method import FullCache
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache
from kvforge.engine.runner import ModelRunner, StepItem

FORMATS = sorted(FP8_DTYPES)
MANTISSA_BITS = {"float8_e4m3fn": 3, "float8_e5m2": 2}


@pytest.mark.parametrize("name", FORMATS)
def test_quantisation_follows_its_definition(name):
    dtype = FP8_DTYPES[name]
    x = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 7)[:, None]
    x[0, 0] = 0.0
    codes, scales = quantize_per_token(x, dtype)
    assert codes.dtype == dtype and scales.shape == x.shape[:-1] and scales.dtype == torch.float32
    amax = x.abs().amax(dim=-1)
    torch.testing.assert_close(scales[amax > 0], amax[amax > 0] / torch.finfo(dtype).max)
    back = dequantize(codes, scales)
    # the largest magnitude of a row is the format's largest value: restored exactly
    torch.testing.assert_close(back.abs().amax(dim=-1), amax, rtol=1e-6, atol=0)
    assert torch.equal(back[0, 0], torch.zeros(64))
    # round to nearest: within half a step of the row's top binade
    bound = amax[..., None] * 2.0 ** -(MANTISSA_BITS[name] + 1)
    assert bool(((back - x).abs() <= bound * (1 + 1e-6)).all())


@pytest.mark.parametrize("name", FORMATS)
def test_bytes_per_token_count_codes_and_scales(name):
    layers, kv_heads, head_dim = 5, 3, 16
    layout = CacheLayout.one_per_layer([CacheLayerSpec(kv_heads, head_dim, 0.25)] * layers)
    cache = create_cache(f"full:storage_dtype={name}", layout, 1 << 22, torch.float32)
    expected = 2 * layers * kv_heads * (head_dim * 1 + 4)
    assert cache.memory.kv_bytes_per_token() == expected
    assert cache.memory.sequence_bytes(16 * 7) == expected * 16 * 7
    held = sum(t.numel() * t.element_size() for t in (cache.k_store, cache.v_store, cache.k_scales, cache.v_scales))
    assert held <= cache.memory.capacity["fast"] and held == cache.pages.pool.num_blocks * cache.page_bytes


class DequantisedFull(FullCache):
    """The definition: float32 pages holding exactly what FP8 pages dequantise to (the
    step's own K/V stays exact in both)."""

    fp8_dtype = torch.float8_e4m3fn

    def _store_rows(self, pages, scales, slots, rows):
        defined = dequantize(*quantize_per_token(rows, self.fp8_dtype))
        pages.view(self.layout.num_kv_heads, -1, self.layout.head_dim).index_copy_(1, slots, defined)

    def fused_decode_target(self, cache_layer, meta):
        return None  # the fused op would store the rows as they are, not as defined here


def _runners(model, name: str, block: int = 4) -> tuple[ModelRunner, ModelRunner]:
    layout = model.cache_layout()
    fp8 = create_cache(f"full:block_size={block},storage_dtype={name}", layout, 1 << 22, torch.float32)
    reference = type("Reference", (DequantisedFull,), {"fp8_dtype": FP8_DTYPES[name]})(
        layout, FullCacheConfig(block_size=block), 1 << 23, torch.float32, torch.device("cpu"))
    return ModelRunner(model, fp8), ModelRunner(model, reference)


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3_hybrid", "mistral_window"])
@pytest.mark.parametrize("name", FORMATS)
def test_attention_over_fp8_pages_equals_attention_over_their_dequantised_rows(arch, name):
    _, model = make_pair(arch)
    fp8, reference = _runners(model, name)
    prompt_a, prompt_b = list(range(3, 40)), list(range(7, 30))
    steps = [
        [StepItem(0, prompt_a[:17], num_logits=0)],  # a prefill chunk
        [StepItem(0, prompt_a[17:])],  # the next chunk attends to FP8 pages of the first
        [StepItem(0, [11]), StepItem(1, prompt_b)],  # decode mixed with a prefill
        [StepItem(0, [12]), StepItem(1, [13])],  # batched decode
        *[[StepItem(0, [20 + i]), StepItem(1, [40 + i])] for i in range(12)],  # past sliding windows
    ]
    for items in steps:
        got, want = fp8.step(items), reference.step(items)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp8_pages_under_swiftkv_and_across_kv_equal_their_dequantised_rows():
    """SwiftKV's later layers read the shared (AcrossKV) cache layers through attend_rows."""
    model = across_kv_model()
    assert model.cache_layout().num_cache_layers == 3
    fp8, reference = _runners(model, "float8_e4m3fn")
    steps = [[StepItem(0, list(range(3, 30)))], [StepItem(0, [5]), StepItem(1, list(range(9, 31)))],
             *[[StepItem(0, [6 + i]), StepItem(1, [30 + i])] for i in range(6)]]
    for items in steps:
        torch.testing.assert_close(fp8.step(items), reference.step(items), atol=1e-5, rtol=1e-5)


def test_fp8_pages_move_the_logits_but_not_far():
    """Not a no-op (the rows are really rounded) and close to exact storage."""
    _, model = make_pair("llama_gqa")
    exact = ModelRunner(model, create_cache("full:block_size=4", model.cache_layout(), 1 << 22, torch.float32))
    fp8, _ = _runners(model, "float8_e4m3fn")
    tokens = list(range(3, 40))
    for runner in (exact, fp8):
        runner.step([StepItem(0, tokens[:20])])
    a = torch.stack([exact.step([StepItem(0, [t])])[0] for t in tokens[20:]])
    b = torch.stack([fp8.step([StepItem(0, [t])])[0] for t in tokens[20:]])
    assert 0 < (a - b).abs().max() < 0.1
