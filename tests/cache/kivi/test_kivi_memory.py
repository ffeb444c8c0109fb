"""KIVI memory accounting: the residual's default dtype (16-bit, as in the paper) and the
bytes a sequence pays for its quantised pages plus its residual, against the analytic values
(smollm2-135m geometry: 30 layers, 3 KV heads, head_dim 64)."""

from __future__ import annotations

import math

import pytest
import torch

from kvforge.cache.kivi.method import KIVICache
from kvforge.cache.kivi.quant import quantized_bits_per_element
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache
from kvforge.errors import ConfigError

LAYERS, KV_HEADS, DIM = 30, 3, 64


def smollm2_like(spec: str, dtype: torch.dtype = torch.float32) -> KIVICache:
    layout = CacheLayout.one_per_layer([CacheLayerSpec(KV_HEADS, DIM, DIM ** -0.5)] * LAYERS)
    cache = create_cache(spec, layout, 512_000_000, dtype)
    assert isinstance(cache, KIVICache)
    return cache


@pytest.mark.parametrize(("dtype", "expected"), [(torch.float32, torch.float16), (torch.float16, torch.float16),
                                                 (torch.bfloat16, torch.bfloat16)])
def test_residual_is_16_bit_by_default(dtype, expected):
    cache = smollm2_like("kivi", dtype)
    assert cache.residual_dtype == expected == cache.store.k_res.dtype == cache.store.v_res.dtype
    assert smollm2_like("kivi:residual_dtype=float32", dtype).residual_dtype == torch.float32


@pytest.mark.parametrize("residual_dtype", ["float16", "float32"])
def test_sequence_bytes_match_the_analytic_value(residual_dtype):
    """Quantised tokens cost codes + fp16 scale/zero per group (0.1875 of fp16 at 2 bits,
    G = 32); each sequence adds its K and V residual of R tokens, rounded up to whole pages."""
    cache = smollm2_like(f"kivi:bits=2,residual_dtype={residual_dtype}")
    per_token = 2 * LAYERS * KV_HEADS * DIM * quantized_bits_per_element(2, 32) / 8
    assert per_token == 0.1875 * 2 * LAYERS * KV_HEADS * DIM * 2 == cache.memory.kv_bytes_per_token()
    element = 2 if residual_dtype == "float16" else 4
    residual = 2 * LAYERS * KV_HEADS * 128 * DIM * element
    assert cache.residual_bytes == residual
    for tokens in (1, 1000, 2048):
        quantised = (tokens // 128) * 128 * per_token
        analytic = quantised + residual
        assert analytic <= cache.memory.sequence_bytes(tokens) <= analytic + cache.page_bytes * (1 + math.ceil(128 / 32))
    assert abs(cache.memory.sequence_bytes(2048) / (2048 * per_token + residual) - 1) < 0.05


# -- the budget split between residual slots and quantised pages ---------------------------
def test_slots_and_pages_split_the_budget():
    """By default a quarter of the budget's pages pay for residual slots; slots and pages together are
    the capacity, within the budget; one sequence more than there are slots is refused while
    pages remain, and admitted once a slot is free."""
    cache = smollm2_like("kivi")
    budget_pages = 512_000_000 // cache.page_bytes
    assert cache.num_slots == (budget_pages // 4) // cache.slot_pages
    assert cache.store.k_res.shape[1] == cache.num_slots
    assert cache.pages.pool.num_blocks == budget_pages - cache.num_slots * cache.slot_pages
    assert cache.memory.capacity["fast"] <= 512_000_000
    for seq in range(cache.num_slots):
        assert cache.allocate(seq, 10)
    assert cache.pages.pool.num_free > 0 and not cache.allocate(cache.num_slots, 10)
    assert cache.memory_usage()["fast"] == cache.num_slots * cache.slot_pages * cache.page_bytes
    cache.free(0)
    assert cache.allocate(cache.num_slots, 10)


def test_max_sequences_sets_the_slots():
    cache = smollm2_like("kivi:max_sequences=3")
    assert cache.num_slots == 3 == cache.store.v_res.shape[1]
    assert all(cache.allocate(seq, 300) for seq in range(3)) and not cache.allocate(3, 1)
    with pytest.raises(ConfigError, match="max_sequences.*100000.*must be <="):
        smollm2_like("kivi:max_sequences=100000")
    with pytest.raises(ConfigError, match="max_sequences.*0"):
        smollm2_like("kivi:max_sequences=0")


def test_fits_together_checks_slots_and_pages():
    """Reserving admission and prompt validation ask `fits_together`: it holds exactly when
    the slots and the quantised pages each suffice, which the byte sum alone does not tell."""
    cache = smollm2_like("kivi:max_sequences=2")
    pages = cache.pages.pool.num_blocks
    longest = pages * cache.config.group  # quantised keys filling every page (one layer group)
    assert cache.memory.fits_together([longest]) and not cache.memory.fits_together([longest + cache.config.residual])
    assert cache.memory.fits_together([1, 1]) and not cache.memory.fits_together([1, 1, 1])
    assert cache.memory.sequence_bytes(1) * 3 <= cache.memory.capacity["fast"]  # the bytes would fit
