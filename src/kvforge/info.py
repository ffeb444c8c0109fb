"""`kvforge info`: what a model is and what its KV cache costs, without loading weights."""

from __future__ import annotations

from typing import Any

import torch

from kvforge.cache.full import STORAGE_DTYPES
from kvforge.cache.registry import create_cache
from kvforge.config import SLIDING_ATTENTION, ModelConfig
from kvforge.models.loader import load_model_config, resolve_model_source
from kvforge.models.registry import MODEL_CLASSES

REPORT_CONTEXTS = (1024, 8192, 32768)


def model_info(name_or_path: str) -> dict[str, Any]:
    source = resolve_model_source(name_or_path)
    config = load_model_config(source)
    layout = MODEL_CLASSES[config.architecture].layout_for(config)
    sliding = sum(t == SLIDING_ATTENTION for t in config.layer_types)
    kv: dict[str, Any] = {}
    for name in STORAGE_DTYPES:
        # One page per group is enough to ask the method for its accounting.
        cache = create_cache(f"full:storage_dtype={name}", layout, 1 << 30, torch.float32, "cpu")
        per_sequence = {str(n): cache.sequence_bytes(n) for n in REPORT_CONTEXTS
                        if n <= config.max_position_embeddings}
        kv[name] = {"bytes_per_token": cache.kv_bytes_per_token(), "bytes_per_sequence": per_sequence}
    return {
        "model": name_or_path,
        "source": str(source.path),
        "format": source.kind,
        "architecture": config.architecture,
        "model_type": config.model_type,
        "parameters": config.num_parameters(),
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
        f"architecture   {info['architecture']} (model_type {info['model_type']})",
        f"parameters     {info['parameters'] / 1e6:.1f} M",
        f"layers         {info['layers']}"
        + (f" ({info['sliding_window_layers']} sliding-window of {info['sliding_window']} tokens)"
           if info["sliding_window_layers"] else ""),
        f"attention      {info['heads']} heads, {info['kv_heads']} KV heads, head_dim {info['head_dim']}",
        f"hidden / vocab {info['hidden_size']} / {info['vocab_size']}"
        + (" (tied embeddings)" if info["tied_embeddings"] else ""),
        f"context        {info['max_position_embeddings']} tokens, RoPE {info['rope']}",
        "KV cache (full method, K and V of every cache layer):",
    ]
    for dtype, entry in info["kv_cache"].items():
        per_seq = ", ".join(f"{int(n) // 1024}K ctx {b / 2**20:.1f} MiB"
                            for n, b in entry["bytes_per_sequence"].items())
        lines.append(f"  {dtype:<9} {entry['bytes_per_token']:>9.0f} bytes/token; per sequence: {per_seq}")
    if info["sliding_window_layers"]:
        lines.append("  (bytes/token counts every layer; sliding-window layers stop growing at their "
                     "window, which the per-sequence figures include)")
    return "\n".join(lines)
