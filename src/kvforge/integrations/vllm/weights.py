"""Checkpoint tensor names (the SwiftKV authors' Hugging Face layout) -> the plugin's
vLLM parameters (pure Python, so it is tested without vLLM).

- layers < l: as vLLM's Llama: q/k/v_proj are shards "q"/"k"/"v" of `qkv_proj`,
  gate/up_proj shards 0/1 of `gate_up_proj`;
- later layers: `q_proj_swiftkv`, `o_proj`, norms and MLP load as named; their original
  q/k/v_proj are ignored (the authors keep them as the distillation teacher);
- leaders' `k_proj_swiftkv`/`v_proj_swiftkv` become row blocks of ONE fused projection
  `model.swiftkv_kv_proj` (layout: the K of every group, then the V of every group, so
  the K half gets RoPE in one call); non-leaders' k/v_proj_swiftkv are ignored;
- `lm_head.weight` is ignored when the embeddings are tied; rotary `inv_freq` buffers are
  ignored; so is kvforge's early-exit head (`model.early_exit_proj`: no early exit in vLLM).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvforge.config import SwiftKVConfig

FUSED_KV = "model.swiftkv_kv_proj"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_ORIGINAL_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_SWIFTKV_KV = {"self_attn.k_proj_swiftkv": 0, "self_attn.v_proj_swiftkv": 1}


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes. `shard`: the shard id passed to vLLM's stacked
    `weight_loader`; `fused_block`: the row block (of num_kv_heads * head_dim rows) in
    the fused SwiftKV K/V projection."""

    param: str
    shard: str | int | None = None
    fused_block: int | None = None


def _split_suffix(rest: str) -> tuple[str, str]:
    module, _, suffix = rest.rpartition(".")
    return module, suffix


def fused_kv_block(layer: int, kind: int, num_layers: int, swift: SwiftKVConfig) -> int:
    """Row block of leader `layer`'s K (kind 0) or V (kind 1) in the fused projection."""
    groups = (num_layers - swift.num_key_value_layers) // swift.key_value_group_size
    slot = (layer - swift.num_key_value_layers) // swift.key_value_group_size
    return kind * groups + slot


def weight_target(name: str, num_layers: int, swift: SwiftKVConfig,
                  tie_word_embeddings: bool) -> WeightTarget | None:
    """The vLLM parameter for checkpoint tensor `name`; None when the plugin ignores it."""
    if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
        return None
    if name == "lm_head.weight" and tie_word_embeddings:
        return None
    if name.startswith("model.early_exit_proj."):
        return None  # kvforge's early-exit head: vLLM decodes every token through all layers
    match = _LAYER.match(name)
    if match is None:
        return WeightTarget(name)
    layer, rest = int(match.group(1)), match.group(2)
    if layer >= num_layers:
        raise ValueError(f"checkpoint tensor {name} names layer {layer} but the model has {num_layers} layers")
    module, suffix = _split_suffix(rest)
    prefix = f"model.layers.{layer}."
    if swift.is_later(layer):
        if module in _ORIGINAL_QKV:
            return None
        if module in _SWIFTKV_KV:
            if not swift.is_leader(layer):
                return None
            return WeightTarget(f"{FUSED_KV}.{suffix}",
                                fused_block=fused_kv_block(layer, _SWIFTKV_KV[module], num_layers, swift))
        if module == "self_attn.q_proj_swiftkv":
            return WeightTarget(prefix + rest)
    elif module.endswith("_swiftkv"):
        return None  # SwiftKV projections of an early layer do not exist in the model
    if module in _STACKED:
        stacked, shard = _STACKED[module]
        return WeightTarget(f"{prefix}{stacked}.{suffix}", shard=shard)
    return WeightTarget(prefix + rest)


def required_swiftkv_names(num_layers: int, swift: SwiftKVConfig, bias: bool) -> list[str]:
    """Checkpoint tensors a SwiftKV model cannot run without (besides the Llama ones)."""
    suffixes = (".weight", ".bias") if bias else (".weight",)
    names = ["model.norm_swiftkv.weight"]
    for layer in range(swift.num_key_value_layers, num_layers):
        projections = ["q_proj_swiftkv"] + (["k_proj_swiftkv", "v_proj_swiftkv"] if swift.is_leader(layer) else [])
        names += [f"model.layers.{layer}.self_attn.{p}{s}" for p in projections for s in suffixes]
    return names
