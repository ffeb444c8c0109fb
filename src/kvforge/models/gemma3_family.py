"""The `gemma3` family's registry entry: Gemma 3 text decoders (and the text part of the
multimodal checkpoints, whose config.json nests it under `text_config`).

What the entry states beyond the Llama layout: four (1 + w) norms per layer and QK-norm
(`qk_norm`), a local RoPE base for sliding-window layers, `query_pre_attn_scalar`, logit
soft-capping, tied embeddings and a 131072-token context by default. llama.cpp stores the
norm weights as 1 + w (restored on reading) and states no layer pattern or attention
scalar for older files: they are filled as transformers' Gemma3TextConfig does.
"""

from __future__ import annotations

from typing import Any

from kvforge.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeConfig
from kvforge.errors import require
from kvforge.models.family import GGUF_COMMON_BLOCK_NAMES, GGUFArchitecture, HFLayout, ModelFamily
from kvforge.models.gemma3 import Gemma3ForCausalLM
from kvforge.models.gemma3_swiftkv import Gemma3SwiftKVForCausalLM
from kvforge.models.gguf_metadata import GGUFMetadata, float32_decimal


def _hf_fields(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    params = config.get("rope_parameters")
    if params and FULL_ATTENTION in params:  # transformers 5.x
        full = params[FULL_ATTENTION]
        local = params.get(SLIDING_ATTENTION, {"rope_theta": 10000.0})
        rope = RopeConfig.from_hf(full.get("rope_theta", 1_000_000.0), full)
        local_rope = RopeConfig.from_hf(local.get("rope_theta", 10000.0), local)
    else:
        rope = RopeConfig.from_hf(config.get("rope_theta", 1_000_000.0), config.get("rope_scaling"))
        local_rope = RopeConfig(theta=float(config.get("rope_local_base_freq", 10000.0)))
    layer_types = config.get("layer_types")
    if not layer_types:
        pattern = int(config.get("sliding_window_pattern", 6))
        layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                       for i in range(int(config["num_hidden_layers"]))]
    return dict(
        max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
        rope=rope,
        local_rope=local_rope,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        attention_bias=bool(config.get("attention_bias", False)),
        hidden_act=config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh",
        sliding_window=int(config.get("sliding_window") or 4096),
        layer_types=tuple(layer_types),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        qk_norm=True,
    )


def _layout_of(config: ModelConfig) -> str:
    local = config.local_rope or config.rope
    require(local.rope_type == "default", "local_rope", local.rope_type,
            "a gemma3 config.json states only the local RoPE base (rope_local_base_freq), no scaling")
    require(not config.attention_out_bias, "attention_out_bias", True, "a gemma3 config.json has no o_proj bias")
    require(not config.mlp_bias, "mlp_bias", True, "a gemma3 config.json has no MLP bias")
    return "gemma3_text"


def _hf_fields_of(config: ModelConfig, layout: str) -> dict[str, Any]:
    """What a gemma3_text config.json states beyond the shape (read by `_hf_fields`)."""
    return {
        "rope_local_base_freq": (config.local_rope or config.rope).theta,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        # transformers 5 declares it an int and refuses 256.0 (an integral value is written as one)
        "query_pre_attn_scalar": (int(config.query_pre_attn_scalar) if float(config.query_pre_attn_scalar).is_integer()
                                  else config.query_pre_attn_scalar),
        "final_logit_softcapping": config.final_logit_softcapping,
        "hidden_activation": config.hidden_act,
        "attention_bias": config.attention_bias,
    }


def _gguf_defaults(meta: GGUFMetadata, config: dict[str, Any]) -> None:
    """Gemma3 fields GGUF does not carry, filled as transformers' Gemma3TextConfig does."""
    n_layers = config["num_hidden_layers"]
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer llama.cpp: one bool per layer, True = sliding
        layer_types = [SLIDING_ATTENTION if flag else FULL_ATTENTION for flag in pattern]
    else:  # layer i is global iff (i + 1) % pattern == 0
        layer_types = [SLIDING_ATTENTION if (i + 1) % int(pattern) else FULL_ATTENTION for i in range(n_layers)]
    config.update(
        layer_types=layer_types,
        sliding_window=int(meta.get("gemma3.attention.sliding_window") or 4096),
        rope_local_base_freq=float32_decimal(meta.get("gemma3.rope.freq_base_swa", 10000.0)),
        hidden_activation="gelu_pytorch_tanh",
        # transformers' default is 256; the 270M/1B/4B/12B use head_dim (=256). Only the 27B
        # (head_dim 128) scales by hidden/heads; llama.cpp recognises it by its 62 layers.
        query_pre_attn_scalar=256.0 if n_layers != 62 else config["hidden_size"] / config["num_attention_heads"],
        final_logit_softcapping=meta.get("gemma3.final_logit_softcapping"),
    )


_GGUF_BLOCK_NAMES = {
    **GGUF_COMMON_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

FAMILY = ModelFamily(
    name="gemma3",
    model_types=("gemma3_text", "gemma3"),
    hf_fields=_hf_fields,
    causal_lm=Gemma3ForCausalLM,
    swiftkv_causal_lm=Gemma3SwiftKVForCausalLM,
    # The authors publish no Gemma3 SwiftKV: `gemma3_text_swiftkv` is kvforge's name by their rule.
    hf_layouts=(HFLayout("gemma3_text", "Gemma3ForCausalLM", "Gemma3SwiftKVForCausalLM"),),
    hf_layout_of=_layout_of,
    hf_fields_of=_hf_fields_of,
    gguf_architectures=(GGUFArchitecture("gemma3", "gemma3_text", _GGUF_BLOCK_NAMES, _gguf_defaults,
                                         norm_weight_offset=1.0),),
    text_config_model_types={"gemma3": "gemma3_text"},
)
