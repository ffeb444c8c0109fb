"""The captured activations are what the model computes: checked against an independent
recomputation from the captured layer inputs and against the dense (cache-free) forward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import make_pair

from kvforge.config import SwiftKVConfig
from kvforge.errors import ConfigError
from kvforge.models.dense import dense_hidden_states
from kvforge.models.registry import build_model
from kvforge.tools.analysis.capture import capture_activations


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "gemma3_hybrid"])
def test_keys_values_and_inputs_match_a_recomputation(name):
    _, model = make_pair(name)
    tokens = [(7 * i + 3) % 90 for i in range(24)]
    acts = capture_activations(model, tokens)
    layers = model.config.num_layers
    assert len(acts.hidden) == layers + 1 and acts.num_layers == layers and acts.num_tokens == 24
    positions = torch.arange(24)
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(acts.hidden[index])
            torch.testing.assert_close(acts.attention_inputs[index], x)
            k = attn.k_proj(x).view(24, attn.num_kv_heads, attn.head_dim)
            if attn.k_norm is not None:  # Gemma3: pre-RoPE keys are after the QK-norm
                k = attn.k_norm(k)
            torch.testing.assert_close(acts.keys_pre[index], k)
            torch.testing.assert_close(acts.values[index], attn.v_proj(x).view(24, attn.num_kv_heads, attn.head_dim))
            rotary = model.rotaries[model.rope_index[index]]
            torch.testing.assert_close(acts.keys_post[index], rotary.at(positions, torch.float32).apply(k))


def test_hidden_states_match_the_dense_forward():
    _, model = make_pair("llama_gqa")
    tokens = [(5 * i + 1) % 90 for i in range(20)]
    acts = capture_activations(model, tokens)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        for layer in range(model.config.num_layers):
            torch.testing.assert_close(acts.hidden[layer], dense_hidden_states(model, ids, output_layer=layer)[0])
        torch.testing.assert_close(acts.hidden[-1], dense_hidden_states(model, ids)[0], rtol=1e-4, atol=1e-4)


def test_capture_leaves_the_model_and_cache_class_untouched():
    _, model = make_pair("llama_gqa")
    capture_activations(model, [1, 2, 3, 4])
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks and not layer.self_attn._forward_pre_hooks
               for layer in model.model.layers)
    again = capture_activations(model, [1, 2, 3, 4])  # a second capture sees fresh state
    assert again.num_tokens == 4


def test_swiftkv_models_are_rejected():
    _, base = make_pair("llama_gqa")
    swift = build_model(replace(base.config, swiftkv=SwiftKVConfig(1, 1)))  # checked before any forward
    with pytest.raises(ConfigError, match="SwiftKV"):
        capture_activations(swift, [1, 2, 3, 4])
