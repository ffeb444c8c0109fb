"""`kvforge info`: what a model is and what its KV cache costs, without loading weights."""

from __future__ import annotations

from typing import Any

import torch

from kvforge.cache.full.method import STORAGE_DTYPES
from kvforge.cache.registry import create_cache
from kvforge.config import SLIDING_ATTENTION, ModelConfig
from kvforge.errors import ConfigError
from kvforge.models.loader import load_model_config, resolve_model_source
from kvforge.models.registry import model_class, num_parameters

REPORT_CONTEXTS = (1024, 8192, 32768)


def model_info(name_or_path: str, swiftkv: str | None = None, load_format: str = "auto") -> dict[str, Any]:
    """From the config alone (`load_format="dummy"`: a shape's, and no weights are drawn)."""
    source = resolve_model_source(name_or_path, load_format)
    config = load_model_config(source)
    if swiftkv is not None:
        from kvforge.models.swiftkv_checkpoint import overlay_config

        config = overlay_config(config, swiftkv)
    layout = model_class(config).layout_for(config)
    sliding = sum(t == SLIDING_ATTENTION for t in config.layer_types)
    kv: dict[str, Any] = {}
    # kivi rows: quantised bytes per token; per sequence adds the float16 residual (R tokens).
    specs = {name: f"full:storage_dtype={name}" for name in STORAGE_DTYPES}
    specs.update({f"kivi-{bits}bit": f"kivi:bits={bits},residual_dtype=float16" for bits in (2, 4)})
    specs["kivi-quality2"] = "kivi:preset=quality2,residual_dtype=float16"  # 4-bit keys, 2-bit values
    specs["kivi-quality3"] = "kivi:preset=quality3,residual_dtype=float16"  # 3.39 bits/element at 4K tokens
    # default rank/budget, fp32; fast tier (values on the slow tier). rank=attention learns each
    # layer's rank at compression, so before data only a range is known.
    specs["shadowkv"] = "shadowkv"
    for name, spec in specs.items():
        # One page per group is enough to ask the method for its accounting.
        try:
            cache = create_cache(spec, layout, 1 << 30, torch.float32, "cpu")
        except ConfigError:  # e.g. kivi's group does not divide this model's head_dim
            continue
        per_sequence = {str(n): cache.memory.sequence_bytes(n) for n in REPORT_CONTEXTS
                        if n <= config.max_position_embeddings}
        kv[name] = {"bytes_per_token": cache.memory.kv_bytes_per_token(), "bytes_per_sequence": per_sequence}
        compressed = getattr(cache.memory, "compressed_sequence_bytes", None)
        if compressed is not None:  # shadowkv: per tier once compressed (exact below min_context)
            tiers = {n: compressed(int(n)) for n in per_sequence}
            kv[name]["bytes_per_sequence"] = {n: t["fast"] for n, t in tiers.items()}
            kv[name]["slow_bytes_per_sequence"] = {n: t["slow"] for n, t in tiers.items()}
            least, most = cache.rank_bounds
            if least < most:
                kv[name]["rank_range"] = [least, most]
                kv[name]["least_bytes_per_sequence"] = {n: compressed(int(n), least)["fast"] for n in per_sequence}
    return {
        "model": name_or_path,
        "source": str(source.path),
        "format": source.kind,
        "weights": source.weights,
        "architecture": config.architecture,
        "model_type": config.model_type,
        "parameters": num_parameters(config),
        "layers": config.num_layers,
        "sliding_window_layers": sliding,
        "sliding_window": config.sliding_window,
        "hidden_size": config.hidden_size,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "tied_embeddings": config.tie_word_embeddings,
        "rope": _rope_text(config),
        "swiftkv": None if config.swiftkv is None else {
            "num_key_value_layers": config.swiftkv.num_key_value_layers,
            "key_value_group_size": config.swiftkv.key_value_group_size,
            "cache_layers": layout.num_cache_layers},
        "kv_cache": kv,
    }


def _rope_text(config: ModelConfig) -> str:
    text = f"theta={config.rope.theta:g} ({config.rope.rope_type})"
    if config.local_rope is not None:
        text += f", sliding layers theta={config.local_rope.theta:g}"
    return text


def format_info(info: dict[str, Any]) -> str:
    lines = [
        f"model          {info['model']} ({info['format']}: {info['source']})",
        *([f"weights        {info['weights']}: for speed only"] if info.get("weights", "checkpoint") != "checkpoint"
          else []),
        f"architecture   {info['architecture']} (model_type {info['model_type']})",
        f"parameters     {info['parameters'] / 1e6:.1f} M",
        f"layers         {info['layers']}"
        + (f" ({info['sliding_window_layers']} sliding-window of {info['sliding_window']} tokens)"
           if info["sliding_window_layers"] else ""),
        f"attention      {info['heads']} heads, {info['kv_heads']} KV heads, head_dim {info['head_dim']}",
        f"hidden / vocab {info['hidden_size']} / {info['vocab_size']}"
        + (" (tied embeddings)" if info["tied_embeddings"] else ""),
        f"context        {info['max_position_embeddings']} tokens, RoPE {info['rope']}",
        *([f"swiftkv        l={info['swiftkv']['num_key_value_layers']}, "
           f"g={info['swiftkv']['key_value_group_size']}: {info['swiftkv']['cache_layers']} cache layers "
           f"for {info['layers']} layers"] if info.get("swiftkv") else []),
        "KV cache (K and V of every cache layer; kivi: codes + fp16 scale/zero per group (32; quality3: 128-token "
        "key, 64-channel value groups), per sequence incl. the fp16 residual of 128 tokens and any sinks):",
    ]
    for dtype, entry in info["kv_cache"].items():
        least = entry.get("least_bytes_per_sequence", {})
        per_seq = ", ".join(f"{int(n) // 1024}K ctx " + (f"{least[n] / 2**20:.1f}-" if least.get(n, b) < b else "")
                            + f"{b / 2**20:.1f} MiB" for n, b in entry["bytes_per_sequence"].items())
        lines.append(f"  {dtype:<13} {entry['bytes_per_token']:>9.0f} bytes/token; per sequence: {per_seq}")
        if "slow_bytes_per_sequence" in entry:
            slow = ", ".join(f"{int(n) // 1024}K ctx {b / 2**20:.1f} MiB"
                             for n, b in entry["slow_bytes_per_sequence"].items())
            ranks = (f"key coefficients of ranks {entry['rank_range'][0]}-{entry['rank_range'][1]} per layer (chosen "
                     "from the keys)" if "rank_range" in entry else "rank-r key coefficients")
            lines.append(f"  {'':<13} (fast tier once compressed: {ranks}, landmarks, exact "
                         f"buffers; slow tier: {slow})")
    if info["sliding_window_layers"]:
        lines.append("  (bytes/token counts every layer; sliding-window layers stop growing at their "
                     "window, which the per-sequence figures include)")
    return "\n".join(lines)
