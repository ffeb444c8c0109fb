"""Tiny SwiftKV models for the tests of this folder."""

from __future__ import annotations

from dataclasses import replace

import torch
from conftest import make_pair

from kvforge.config import SwiftKVConfig
from kvforge.models.registry import build_model
from kvforge.swiftkv.checkpoint import initial_swiftkv_tensors, model_state_for_swiftkv


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


def across_kv_pair():
    """A 5-layer llama with l = 1 and groups of 2 later layers (AcrossKV)."""
    hf_pair = make_pair("llama_gqa")[1]
    config = replace(hf_pair.config, num_layers=5, layer_types=())
    torch.manual_seed(4)
    base = build_model(config)
    with torch.no_grad():
        for name, p in base.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
    return base, swiftkv_model(base, 1, 2)
