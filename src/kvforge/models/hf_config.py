"""A Hugging Face `config.json` dictionary -> ModelConfig, for every registered family.

The one entry point (`config_from_hf_dict`): HF checkpoint directories, GGUF files (their
metadata is first translated into this form) and SwiftKV checkpoints all go through it.
The shape fields every decoder states the same way are read here; the family's own part
(RoPE layout, biases, windows, norms) by its registry entry (models/family.py).
"""

from __future__ import annotations

from typing import Any

from kvforge.config import ModelConfig, SwiftKVConfig
from kvforge.models.family import SWIFTKV_SUFFIX, family_of_model_type


def config_from_hf_dict(config: dict[str, Any]) -> ModelConfig:
    """Build from a Hugging Face config.json dictionary (transformers 4.x and 5.x spellings
    of RoPE parameters both work); ConfigError names an unsupported model_type or value."""
    model_type = config.get("model_type")
    family = family_of_model_type(model_type)
    nested_type = family.text_config_model_types.get(model_type)
    if nested_type is not None and "text_config" in config:
        text = dict(config["text_config"])
        text.setdefault("model_type", nested_type)
        return config_from_hf_dict(text)
    swiftkv = model_type in family.swiftkv_model_types
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    fields: dict[str, Any] = dict(
        architecture=family.name,
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        swiftkv=SwiftKVConfig.from_hf(config) if swiftkv else None,
    )
    base_type = model_type.removesuffix(SWIFTKV_SUFFIX) if swiftkv else model_type
    fields.update(family.hf_fields(config, base_type))
    return ModelConfig(**fields)
