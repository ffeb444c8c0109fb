"""Stored bits per K/V element (eval/storage.py), the x axis of the KIVI Pareto table."""

from __future__ import annotations

import pytest
import torch

from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache
from kvforge.tools.eval.storage import hf_quantized_storage, kvforge_storage

LAYOUT = CacheLayout.one_per_layer([CacheLayerSpec(3, 64, 0.125)] * 4)


@pytest.mark.parametrize(("spec", "bits"), [
    ("full", 32.0),
    ("full:storage_dtype=float16", 16.0),
    ("kivi:bits=2", 2 + 16 / 32 + 16 / 32),  # codes + fp16 scale and zero per 32 (keys and values)
    ("kivi:bits=4", 4 + 1.0),
    ("kivi:bits=2,key_group=16,value_group=64", 2 + 16 / 16 + 16 / 64),
])
def test_bits_per_element_follow_the_formats(spec, bits):
    storage = kvforge_storage(create_cache(spec, LAYOUT, 1 << 24, torch.float32), 2048)
    assert storage["quantized_bits_per_element"] == pytest.approx(bits)


def test_kivi_sinks_are_amortised_over_the_window_and_the_residual_reported_beside():
    storage = kvforge_storage(create_cache("kivi:bits=2,sinks=4", LAYOUT, 1 << 24, torch.float32), 2048)
    assert storage["stored_bits_per_element"] == pytest.approx(3.0 + 4 * 16 / 2048)
    assert (storage["residual_tokens"], storage["residual_bits"], storage["sinks"]) == (128, 16, 4)


def test_hf_quantized_groups_carry_scale_and_zero_in_the_model_dtype():
    assert hf_quantized_storage(2, 64, 128, torch.float32)["stored_bits_per_element"] == pytest.approx(3.0)
    assert hf_quantized_storage(4, 32, 128, torch.float16)["stored_bits_per_element"] == pytest.approx(5.0)
