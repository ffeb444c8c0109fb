"""The `llama` family's registry entry: Llama 2/3/3.1, Mistral, Qwen2, SmolLM2.

config.json: Qwen2 has biases on q/k/v and none on o_proj, and slides only with
`use_sliding_window` (from layer `max_window_layers` on); a Llama `attention_bias` covers
q/k/v and o_proj; a Mistral `sliding_window` without `layer_types` slides on every layer.
GGUF: llama.cpp's converter permutes the Q/K rows of `llama` files (not of `qwen2` ones).
"""

from __future__ import annotations

from typing import Any

from kvforge.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeConfig
from kvforge.errors import ConfigError
from kvforge.models.family import GGUF_COMMON_BLOCK_NAMES, GGUFArchitecture, HFLayout, ModelFamily
from kvforge.models.gguf_metadata import GGUFMetadata
from kvforge.models.llama import LlamaForCausalLM
from kvforge.models.llama_swiftkv import LlamaSwiftKVForCausalLM


def _hf_fields(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    num_layers = int(config["num_hidden_layers"])
    params = config.get("rope_parameters")
    if params:  # transformers 5.x: one dict holding theta and scaling
        rope = RopeConfig.from_hf(params.get("rope_theta", config.get("rope_theta", 10000.0)), params)
    else:
        rope = RopeConfig.from_hf(config.get("rope_theta", 10000.0), config.get("rope_scaling"))
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if model_type == "qwen2":
        # Qwen2 ignores sliding_window unless use_sliding_window is set.
        if not config.get("use_sliding_window", False):
            window, layer_types = None, None
        elif not layer_types:
            start = int(config.get("max_window_layers", num_layers))
            layer_types = [SLIDING_ATTENTION if i >= start else FULL_ATTENTION for i in range(num_layers)]
    if window and not layer_types:
        layer_types = [SLIDING_ATTENTION] * num_layers  # Mistral: every layer slides
    return dict(
        rope=rope,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else bool(config.get("attention_bias", False)),
        attention_out_bias=model_type != "qwen2" and bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        hidden_act=config.get("hidden_act", "silu"),
        sliding_window=int(window) if window and layer_types else None,
        layer_types=tuple(layer_types or ()),
    )


def _layout_of(config: ModelConfig) -> str:
    """The layout that states the attention biases: `llama` (one `attention_bias` for q/k/v
    and o) or `qwen2` (biases on q/k/v, none on o)."""
    if config.attention_bias == config.attention_out_bias:
        return "llama"
    if config.attention_bias:
        return "qwen2"
    raise ConfigError("attention_bias", (config.attention_bias, config.attention_out_bias),
                      "a bias on o_proj without q/k/v biases has no config.json layout (llama: one "
                      "attention_bias for q/k/v and o; qwen2: q/k/v biases only)")


def _window_fields(config: ModelConfig, layout: str) -> dict[str, Any]:
    """Sliding-window fields in the layout's spelling; `layer_types` always states which
    layers slide, so the config reads back layer for layer."""
    if config.sliding_window is None:
        return {"use_sliding_window": False} if layout == "qwen2" else {}
    out: dict[str, Any] = {"sliding_window": config.sliding_window, "layer_types": list(config.layer_types)}
    if layout == "qwen2":
        # Qwen2 slides only with use_sliding_window, from layer max_window_layers on.
        first_sliding = next(i for i in range(config.num_layers) if config.is_sliding(i))
        out.update(use_sliding_window=True, max_window_layers=first_sliding)
    return out


def _hf_fields_of(config: ModelConfig, layout: str) -> dict[str, Any]:
    out: dict[str, Any] = {"mlp_bias": config.mlp_bias, "hidden_act": config.hidden_act}
    if layout == "llama":  # Qwen2's biases are implied by its model_type
        out["attention_bias"] = config.attention_bias
    return out | _window_fields(config, layout)


def _gguf_window(meta: GGUFMetadata, config: dict[str, Any]) -> None:
    """llama (Mistral): every layer slides. qwen2: the window is ignored unless
    use_sliding_window is set, and GGUF has no such flag, so Qwen2 stays full attention."""
    window = meta.get(f"{meta.get('general.architecture')}.attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)


_GGUF_BLOCK_NAMES = {**GGUF_COMMON_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}

FAMILY = ModelFamily(
    name="llama",
    model_types=("llama", "mistral", "qwen2"),
    hf_fields=_hf_fields,
    causal_lm=LlamaForCausalLM,
    swiftkv_causal_lm=LlamaSwiftKVForCausalLM,
    hf_layouts=(HFLayout("llama", "LlamaForCausalLM", "LlamaSwiftKVForCausalLM"),
                HFLayout("qwen2", "Qwen2ForCausalLM", "Qwen2SwiftKVForCausalLM")),
    hf_layout_of=_layout_of,
    hf_fields_of=_hf_fields_of,
    gguf_architectures=(GGUFArchitecture("llama", "llama", _GGUF_BLOCK_NAMES, _gguf_window, permuted_qk=True),
                        GGUFArchitecture("qwen2", "qwen2", _GGUF_BLOCK_NAMES, _gguf_window)),
)
