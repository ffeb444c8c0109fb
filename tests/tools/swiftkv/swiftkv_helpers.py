"""Tiny SwiftKV models for the tests of this folder."""

from __future__ import annotations

from dataclasses import replace

import torch
import transformers
from conftest import TINY, make_pair

from kvforge.config import SwiftKVConfig
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.models.registry import build_model
from kvforge.models.swiftkv_checkpoint import initial_swiftkv_tensors, model_state_for_swiftkv


def swiftkv_model(base, first_later: int, group: int, seed: int = 0, perturb: bool = True):
    """A SwiftKV model built from `base` (kvforge), initialised like `kvforge swiftkv init`,
    then perturbed so a wiring mistake cannot hide behind the initialisation."""
    config = replace(base.config, swiftkv=SwiftKVConfig(first_later, group))
    state = {k: v.clone() for k, v in base.state_dict().items()}
    state.update(initial_swiftkv_tensors(state, base.config, config.swiftkv))
    if perturb:
        generator = torch.Generator().manual_seed(seed)
        for name in list(state):
            if "swiftkv" in name:
                state[name] = state[name] + 0.05 * torch.randn(state[name].shape, generator=generator)
    model = build_model(config)
    model.load_hf_state_dict(model_state_for_swiftkv(state, config))
    return model


def random_base(config, seed: int = 4):
    """A base model of `config` with random weights; norms near their identity (w ~ 1, or
    w ~ 0 for Gemma's (1 + w) norms)."""
    torch.manual_seed(seed)
    base = build_model(config)
    identity = 0.0 if config.architecture == "gemma3" else 1.0
    with torch.no_grad():
        for name, p in base.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + (identity if "norm" in name else 0.0))
    return base


def across_kv_pair():
    """A 5-layer llama with l = 1 and groups of 2 later layers (AcrossKV)."""
    hf_pair = make_pair("llama_gqa")[1]
    base = random_base(replace(hf_pair.config, num_layers=5, layer_types=()))
    return base, swiftkv_model(base, 1, 2)


# Six Gemma3 layers whose later layers (l = 2) are a global pair then a sliding pair, so
# AcrossKV groups of 2 keep one kind each while the later layers mix both.
GEMMA3_MIXED_TYPES = ("sliding_attention", "full_attention", "full_attention", "full_attention",
                      "sliding_attention", "sliding_attention")


def gemma3_across_kv_pair(group: int = 2):
    """A 6-layer Gemma3 (window 10, local and global RoPE) with l = 2 and AcrossKV groups of
    `group` over mixed sliding/global later layers."""
    config = replace(make_pair("gemma3_hybrid")[1].config, num_layers=6, layer_types=GEMMA3_MIXED_TYPES)
    base = random_base(config)
    return base, swiftkv_model(base, 2, group)


def qwen2_pair(layers: int, seed: int = 3):
    """(transformers Qwen2ForCausalLM, kvforge model) with the same random weights, non-trivial
    biases and norms."""
    torch.manual_seed(seed)
    hf_config = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": layers, "num_key_value_heads": 2})
    hf_config._attn_implementation = "eager"
    hf = transformers.Qwen2ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    base = build_model(config_from_hf_dict(hf_config.to_dict()))
    base.load_hf_state_dict(hf.state_dict())
    return hf, base
