"""SwiftKV's wiring written out as tables: which cache layer each model layer reads and
which later layers are group leaders (their k/v_proj_swiftkv write the group's K/V)."""

from __future__ import annotations

import pytest

from kvforge.config import SwiftKVConfig
from kvforge.models.llama_swiftkv import LlamaSwiftKVForCausalLM


@pytest.mark.parametrize("first_later, g, cache_layers, leaders", [
    # 8 layers; layers < l own their cache layer; later ones read l + (i - l) // g
    (8, 1, [0, 1, 2, 3, 4, 5, 6, 7], []),
    (4, 1, [0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7]),
    (4, 2, [0, 1, 2, 3, 4, 4, 5, 5], [4, 6]),
    (2, 3, [0, 1, 2, 2, 2, 3, 3, 3], [2, 5]),
    (4, 4, [0, 1, 2, 3, 4, 4, 4, 4], [4]),
])
def test_cache_layer_and_leader_tables(first_later, g, cache_layers, leaders):
    swift = SwiftKVConfig(first_later, g)
    assert [swift.cache_layer_of(i) for i in range(8)] == cache_layers
    assert [i for i in range(8) if swift.is_leader(i)] == leaders == list(swift.leaders(8))
    assert swift.num_cache_layers(8) == max(cache_layers) + 1
    # every leader is the first layer reading its cache layer
    for leader in leaders:
        assert cache_layers.index(cache_layers[leader]) == leader


def test_the_model_layout_follows_the_table():
    from kvforge.models.hf_config import config_from_hf_dict

    config = config_from_hf_dict({"model_type": "llama_swiftkv", "vocab_size": 32, "hidden_size": 16,
                                       "intermediate_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "num_hidden_layers": 8, "max_position_embeddings": 64,
                                       "swiftkv": True, "num_key_value_layers": 2, "key_value_group_size": 3})
    layout = LlamaSwiftKVForCausalLM.layout_for(config)
    assert layout.layer_to_cache == (0, 1, 2, 2, 2, 3, 3, 3)
    model = LlamaSwiftKVForCausalLM(config)
    with_kv = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.self_attn, "k_proj_swiftkv")]
    assert with_kv == [2, 5]
