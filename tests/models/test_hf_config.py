"""config.json -> ModelConfig, value by value: the rules each family's parser states
(grouped-query heads, Llama's one attention_bias, Qwen2's q/k/v biases and window flag,
Mistral's all-sliding window, Gemma3's defaults), RoPE scaling in both transformers
spellings and the SwiftKV fields. Every expected value is written literally, so a parser
that drifts fails on the field it got wrong; the rotary frequencies are checked against
transformers' own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvforge.config import FULL_ATTENTION, SLIDING_ATTENTION, RopeConfig, SwiftKVConfig
from kvforge.errors import ConfigError
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.rope import rope_inverse_frequencies

F, S = FULL_ATTENTION, SLIDING_ATTENTION
SHAPE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
         "num_attention_heads": 4}


def config(model_type: str, **fields: Any):
    return config_from_hf_dict({"model_type": model_type, **SHAPE, **fields})


def test_grouped_query_heads_and_head_dim():
    c = config("llama", num_key_value_heads=2)
    assert (c.architecture, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 4, 2, 8)
    assert config("llama").num_kv_heads == 4  # no num_key_value_heads: one KV head per query head
    assert config("llama", head_dim=16).head_dim == 16
    c = config("llama")
    assert (c.rms_norm_eps, c.max_position_embeddings, c.rope, c.tie_word_embeddings, c.hidden_act) == \
        (1e-6, 4096, RopeConfig(10000.0), False, "silu")
    assert not c.qk_norm and c.swiftkv is None and c.layer_types == (F,) * 4


def test_eos_ids_take_every_spelling():
    assert config("llama", eos_token_id=[2, 7], bos_token_id=1).eos_token_ids == (2, 7)
    assert config("llama", eos_token_id=2).eos_token_ids == (2,)
    assert config("llama").eos_token_ids == () and config("llama").bos_token_id is None


def test_a_llama_attention_bias_covers_q_k_v_and_o():
    c = config("llama", attention_bias=True, mlp_bias=True)
    assert (c.attention_bias, c.attention_out_bias, c.mlp_bias) == (True, True, True)
    c = config("llama")
    assert (c.attention_bias, c.attention_out_bias, c.mlp_bias) == (False, False, False)


def test_qwen2_has_q_k_v_biases_and_none_on_o():
    c = config("qwen2")
    assert (c.architecture, c.attention_bias, c.attention_out_bias) == ("llama", True, False)
    c = config("qwen2", attention_bias=True)
    assert (c.attention_bias, c.attention_out_bias) == (True, False)


def test_qwen2_slides_only_with_use_sliding_window():
    c = config("qwen2", sliding_window=8)
    assert c.sliding_window is None and c.layer_types == (F,) * 4
    c = config("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=2)
    assert c.sliding_window == 8 and c.layer_types == (F, F, S, S)
    assert config("qwen2", sliding_window=8, use_sliding_window=True).layer_types == (F,) * 4


def test_a_mistral_window_slides_every_layer():
    c = config("mistral", sliding_window=8)
    assert c.sliding_window == 8 and c.layer_types == (S,) * 4 and c.window_of(3) == 8
    c = config("llama", sliding_window=8, layer_types=[F, S, F, S])
    assert c.layer_types == (F, S, F, S) and c.window_of(0) is None and c.window_of(1) == 8


def test_gemma3_defaults():
    c = config("gemma3_text", num_hidden_layers=12, head_dim=8)
    assert (c.architecture, c.model_type) == ("gemma3", "gemma3_text")
    assert c.tie_word_embeddings and c.qk_norm and c.hidden_act == "gelu_pytorch_tanh"
    assert (c.query_pre_attn_scalar, c.sliding_window, c.max_position_embeddings) == (256.0, 4096, 131072)
    assert c.attention_scale == 256.0 ** -0.5
    assert c.layer_types == ((S,) * 5 + (F,)) * 2
    assert (c.rope, c.local_rope) == (RopeConfig(1_000_000.0), RopeConfig(10000.0))
    assert (c.rope_of(0), c.rope_of(5)) == (RopeConfig(10000.0), RopeConfig(1_000_000.0))
    c = config("gemma3_text", sliding_window_pattern=2, rope_local_base_freq=500.0, tie_word_embeddings=False)
    assert c.layer_types == (S, F, S, F) and c.local_rope == RopeConfig(500.0) and not c.tie_word_embeddings


def test_a_multimodal_gemma3_config_reads_its_text_config():
    c = config_from_hf_dict({"model_type": "gemma3", "text_config": {**SHAPE, "head_dim": 8}})
    assert (c.architecture, c.model_type, c.head_dim) == ("gemma3", "gemma3_text", 8)


def test_rope_scaling_in_both_spellings():
    c = config("llama", rope_theta=500.0, rope_scaling={"type": "linear", "factor": 4.0})  # transformers 4.x
    assert c.rope == RopeConfig(500.0, "linear", factor=4.0)
    c = config("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                         "low_freq_factor": 2.0, "high_freq_factor": 3.0})  # transformers 5.x
    assert c.rope == RopeConfig(5e5, "llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=3.0,
                                original_max_position_embeddings=8192)
    assert config("llama", rope_scaling={"rope_type": "default", "factor": 4.0}).rope == RopeConfig(10000.0)
    c = config("gemma3_text", rope_parameters={F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                               S: {"rope_type": "default", "rope_theta": 1e4}})
    assert (c.rope, c.local_rope) == (RopeConfig(1e6, "linear", factor=8.0), RopeConfig(1e4))
    with pytest.raises(ConfigError, match="rope_scaling.rope_type='yarn'.*default, linear and llama3"):
        config("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0})


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rotary_frequencies_are_transformers_frequencies(scaling):
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500.0,
                                  max_position_embeddings=1024, rope_scaling=scaling)
    ours = rope_inverse_frequencies(16, config_from_hf_dict(hf.to_dict()).rope)
    if scaling is None:
        expected = 1.0 / 500.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    else:
        expected = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")[0]
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def test_swiftkv_fields():
    c = config("llama_swiftkv", num_key_value_layers=2)  # `swiftkv` absent: true
    assert (c.architecture, c.model_type, c.swiftkv) == ("llama", "llama_swiftkv", SwiftKVConfig(2, 1))
    c = config("qwen2_swiftkv", swiftkv=True, num_key_value_layers=2, key_value_group_size=2, early_exit_head=True)
    assert c.swiftkv == SwiftKVConfig(2, 2, early_exit_head=True)
    assert (c.attention_bias, c.attention_out_bias) == (True, False)  # read as Qwen2
    assert config("gemma3_text_swiftkv", num_key_value_layers=2, head_dim=8).qk_norm
    assert config("llama_swiftkv", swiftkv=False).swiftkv is None
    with pytest.raises(ConfigError, match="num_key_value_layers"):
        config("llama_swiftkv")


def test_an_unknown_model_type_is_named_with_the_supported_ones():
    with pytest.raises(ConfigError, match=r"model_type='gpt2'.*supported model types are") as error:
        config("gpt2")
    for known in ("gemma3", "gemma3_text", "gemma3_text_swiftkv", "llama", "llama_swiftkv", "mistral", "qwen2",
                  "qwen2_swiftkv"):
        assert f"'{known}'" in str(error.value)
    with pytest.raises(ConfigError, match="model_type='mistral_swiftkv'"):  # the authors publish no such layout
        config("mistral_swiftkv", num_key_value_layers=2)
