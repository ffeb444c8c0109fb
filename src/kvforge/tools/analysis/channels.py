"""KIVI's motivation: keys have a few channels of much larger magnitude than the rest
(fixed channels across tokens), values do not; hence keys are quantized per channel and
values per token.

A channel is one of the kv_heads * head_dim coordinates of a layer's K or V; its magnitude
is the mean absolute value over the passage's tokens. The outlier score of a layer is the
largest channel magnitude over the median one.
"""

from __future__ import annotations

from typing import Any

import torch

from kvforge.errors import require
from kvforge.tools.analysis.capture import Activations


def channel_magnitude(x: torch.Tensor) -> torch.Tensor:
    """Mean |x| over tokens per channel: [T, heads, dim] or [T, C] -> [heads * dim] (float64)."""
    require(x.dim() >= 2 and x.shape[0] >= 1, "x", tuple(x.shape), "must be [tokens, ...] with >= 1 token")
    return x.reshape(x.shape[0], -1).double().abs().mean(dim=0)


def max_median_ratio(magnitude: torch.Tensor) -> float:
    """Largest channel magnitude over the median one (1 when all channels are alike)."""
    median = magnitude.median()
    require(bool(median > 0), "magnitude", "median 0", "needs a positive median channel magnitude")
    return float(magnitude.max() / median)


def kv_channels(acts: Activations, layer: int) -> dict[str, Any]:
    """Numbers of the `kv-channels` analysis: outlier ratios of every layer, and the
    channel magnitudes of the representative `layer`. Keys are post-RoPE (what the cache
    and KIVI quantize); pre-RoPE ratios are kept for comparison."""
    require(0 <= layer < acts.num_layers, "layer", layer, f"must be in [0, {acts.num_layers})")
    ratios: dict[str, list[float]] = {"keys_post_rope": [], "keys_pre_rope": [], "values": []}
    top_key_channels = []
    for index in range(acts.num_layers):
        keys = channel_magnitude(acts.keys_post[index])
        ratios["keys_post_rope"].append(max_median_ratio(keys))
        ratios["keys_pre_rope"].append(max_median_ratio(channel_magnitude(acts.keys_pre[index])))
        ratios["values"].append(max_median_ratio(channel_magnitude(acts.values[index])))
        top_key_channels.append(int(keys.argmax()))
    return {
        "layer": layer, "num_tokens": acts.num_tokens,
        "num_kv_heads": acts.keys_post[0].shape[1], "head_dim": acts.keys_post[0].shape[2],
        "max_median_ratio": ratios, "top_key_channel": top_key_channels,
        "key_magnitude": channel_magnitude(acts.keys_post[layer]).tolist(),
        "value_magnitude": channel_magnitude(acts.values[layer]).tolist(),
    }


def summarise_kv_channels(result: dict[str, Any]) -> str:
    ratios = result["max_median_ratio"]
    layer = result["layer"]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return "\n".join([
        f"max/median channel magnitude, mean over layers: keys {mean(ratios['keys_post_rope']):.2f} "
        f"(pre-RoPE {mean(ratios['keys_pre_rope']):.2f}), values {mean(ratios['values']):.2f}",
        f"layer {layer}: keys {ratios['keys_post_rope'][layer]:.2f} (largest channel "
        f"{result['top_key_channel'][layer]}), values {ratios['values'][layer]:.2f}",
        f"layers where the key ratio exceeds the value ratio: "
        f"{sum(k > v for k, v in zip(ratios['keys_post_rope'], ratios['values']))} of {len(ratios['values'])}",
    ])
