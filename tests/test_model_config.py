"""ModelConfig, RopeConfig and SwiftKVConfig refuse what no model can run, naming the
parameter, the value and the rule, and fill their defaults as documented."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvforge.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeConfig, SwiftKVConfig
from kvforge.errors import ConfigError

BASE = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=128,
                   rope=RopeConfig(10000.0))


@pytest.mark.parametrize(("fields", "message"), [
    (dict(num_kv_heads=3), r"num_kv_heads=3: must divide num_heads=4"),
    (dict(num_heads=2, num_kv_heads=4), r"num_kv_heads=4: must divide num_heads=2"),
    (dict(num_kv_heads=0), r"num_kv_heads=0: must be a positive integer"),
    (dict(head_dim=7), r"head_dim=7: must be even"),
    (dict(vocab_size=0), r"vocab_size=0: must be a positive integer"),
    (dict(num_layers=2.0), r"num_layers=2.0: must be a positive integer"),
    (dict(rms_norm_eps=0.0), r"rms_norm_eps=0.0: must be > 0"),
    (dict(hidden_act="relu"), r"hidden_act='relu': supported activations are silu and gelu_pytorch_tanh"),
    (dict(layer_types=(FULL_ATTENTION,) * 3), r"layer_types=3: must have one entry per layer \(num_layers=4\)"),
    (dict(layer_types=("full_attention", "local", "full_attention", "full_attention")),
     r"layer_types=\['local'\]: entries must be one of"),
    (dict(layer_types=(SLIDING_ATTENTION,) * 4), r"sliding_window=None: must be a positive integer when a layer "
                                                 r"uses sliding attention"),
    (dict(layer_types=(SLIDING_ATTENTION,) * 4, sliding_window=0), r"sliding_window=0"),
    (dict(query_pre_attn_scalar=0.0), r"query_pre_attn_scalar=0.0: must be > 0"),
    (dict(architecture=""), r"architecture='': must name a model family"),
    (dict(swiftkv=SwiftKVConfig(5)), r"num_key_value_layers=5: must be in \[1, num_layers=4\]"),
    (dict(swiftkv=SwiftKVConfig(1, 2)), r"key_value_group_size=2: must divide the number of later layers"),
])
def test_a_config_no_model_can_run_is_refused_by_name(fields, message):
    with pytest.raises(ConfigError, match=message):
        replace(BASE, **fields)


def test_defaults():
    assert BASE.layer_types == (FULL_ATTENTION,) * 4 and BASE.window_of(0) is None
    assert BASE.attention_scale == 8 ** -0.5 and replace(BASE, query_pre_attn_scalar=32.0).attention_scale == 32 ** -0.5
    sliding = replace(BASE, layer_types=(SLIDING_ATTENTION, FULL_ATTENTION) * 2, sliding_window=6,
                      local_rope=RopeConfig(500.0))
    assert [sliding.window_of(i) for i in range(4)] == [6, None, 6, None]
    assert [sliding.rope_of(i).theta for i in range(4)] == [500.0, 10000.0, 500.0, 10000.0]
    assert replace(BASE, layer_types=(SLIDING_ATTENTION,) * 4, sliding_window=6).rope_of(0) == BASE.rope
    assert not BASE.qk_norm and BASE.swiftkv is None


@pytest.mark.parametrize(("fields", "message"), [
    (dict(theta=0.0), r"rope_theta=0.0: must be > 0"),
    (dict(theta=1e4, rope_type="yarn"), r"rope_type='yarn': supported RoPE types are default, linear and llama3"),
    (dict(theta=1e4, rope_type="linear", factor=0.5), r"rope_scaling.factor=0.5: must be >= 1"),
    (dict(theta=1e4, rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0),
     r"rope_scaling.high_freq_factor=4.0: must be greater than low_freq_factor"),
])
def test_a_rope_no_model_can_run_is_refused_by_name(fields, message):
    with pytest.raises(ConfigError, match=message):
        RopeConfig(**fields)


def test_rope_scaling_defaults():
    assert RopeConfig.from_hf(500.0, None) == RopeConfig(500.0)
    assert RopeConfig.from_hf(500, {"type": "linear", "factor": 2}) == RopeConfig(500.0, "linear", factor=2.0)
    llama3 = RopeConfig.from_hf(5e5, {"rope_type": "llama3", "factor": 8})
    assert (llama3.low_freq_factor, llama3.high_freq_factor, llama3.original_max_position_embeddings) == \
        (1.0, 4.0, 8192)
    with pytest.raises(ConfigError, match="rope_scaling.rope_type='dynamic'"):
        RopeConfig.from_hf(1e4, {"rope_type": "dynamic", "factor": 2.0})


def test_swiftkv_fields_from_a_config_json():
    assert SwiftKVConfig.from_hf({"num_key_value_layers": 3}) == SwiftKVConfig(3, 1)
    assert SwiftKVConfig.from_hf({"num_key_value_layers": 3, "key_value_group_size": None}) == SwiftKVConfig(3, 1)
    assert SwiftKVConfig.from_hf({"swiftkv": False, "num_key_value_layers": 3}) is None
    with pytest.raises(ConfigError, match="num_key_value_layers=None: a SwiftKV config with swiftkv=true needs it"):
        SwiftKVConfig.from_hf({"swiftkv": True})
    with pytest.raises(ConfigError, match="key_value_group_size=0: must be an integer >= 1"):
        SwiftKVConfig(2, 0)
