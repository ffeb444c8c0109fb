"""The transformers config class for `model_type: llama_swiftkv` (imports transformers).

transformers does not know `llama_swiftkv`; vLLM reads config.json through AutoConfig, so
`register()` registers this class. It is a LlamaConfig: the SwiftKV keys
(`swiftkv`, `num_key_value_layers`, `key_value_group_size`) ride along as extra attributes.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, LlamaConfig

from kvforge.config import SwiftKVConfig

MODEL_TYPE = "llama_swiftkv"


class LlamaSwiftKVConfig(LlamaConfig):
    model_type = MODEL_TYPE


def register_hf_config() -> None:
    """Idempotent: AutoConfig maps `llama_swiftkv` to LlamaSwiftKVConfig."""
    AutoConfig.register(MODEL_TYPE, LlamaSwiftKVConfig, exist_ok=True)


def swiftkv_of(hf_config: Any) -> SwiftKVConfig:
    """The SwiftKV wiring of a loaded config (ValueError when it is not a SwiftKV one)."""
    if not getattr(hf_config, "swiftkv", True):
        raise ValueError("config.json has swiftkv=false: serve it as a plain Llama model")
    layers = getattr(hf_config, "num_key_value_layers", None)
    if layers is None:
        raise ValueError("a llama_swiftkv config.json needs num_key_value_layers")
    swift = SwiftKVConfig(int(layers), int(getattr(hf_config, "key_value_group_size", None) or 1))
    swift.check_layers(int(hf_config.num_hidden_layers))
    return swift
