"""benchmarks/shadowkv_ranks.py's measurement: one compression of a passage per setting,
the ranks read back per global layer in order."""

from __future__ import annotations

import pytest
from conftest import make_pair

from kvforge.errors import ConfigError
from kvforge.tools.eval.shadowkv_ranks import layer_ranks, measure_ranks

SMALL = "shadowkv:chunk=4,local=8,outliers=2,min_context=24,generated_window=8"


def test_measured_ranks_are_the_settings_ranks_per_global_layer():
    _, model = make_pair("gemma3_hybrid")
    layout = model.cache_layout()
    width = layout.num_kv_heads * layout.head_dim
    tokens = list(range(3, 60))
    fixed, full, attention = measure_ranks(model, tokens, [f"{SMALL},rank=5", f"{SMALL},rank=auto,energy=1.0",
                                                           f"{SMALL},rank=attention,attention_error=0.9,rank_min=2"],
                                           chunk_tokens=16)
    globals_ = [c for c, s in enumerate(layout.specs) if s.sliding_window is None]
    assert fixed["global_layers"] == globals_ and len(globals_) >= 1
    assert fixed["ranks"] == [5] * len(globals_) and full["ranks"] == [width] * len(globals_)
    assert attention["ranks"] == [2] * len(globals_)  # a 90% error target: the first candidate


def test_a_passage_too_short_to_compress_is_refused():
    _, model = make_pair("llama_gqa")
    with pytest.raises(ConfigError, match="min_context"):
        measure_ranks(model, list(range(3, 20)), [f"{SMALL},rank=5"])
    with pytest.raises(ConfigError, match="specs"):
        measure_ranks(model, list(range(3, 40)), ["full"])


def test_layer_ranks_orders_the_global_layers():
    assert layer_ranks({"rank_layer_1": 7.0, "rank_layer_0": 3.0, "rank_mean": 5.0}) == [3, 7]
