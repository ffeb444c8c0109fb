"""The SwiftKV paper's "Merge-all-Layers" reference for throughput under a KV budget.

Every model layer still computes its K/V and attends as usual, but all of them share ONE
stored cache layer: the ideal compression of the cache (1/L of the base model's bytes per
token) at the base model's compute. It bounds what any cross-layer KV sharing can buy when
memory decides throughput. Its outputs are not meaningful (a layer attends to the past K/V
of the last layer), so it is a benchmark system only.

How: the cache method is built on a one-layer layout, and `MergedLayersCache` sends every
model layer's `write`, `attend` and `attend_rows` to that layer. Within a step, layer i
writes its K/V for the step's tokens (overwriting layer i - 1's) before it attends, so the
step's own tokens are always the layer's own; earlier tokens hold the last layer's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from kvforge.cache.layout import CacheLayout
from kvforge.errors import require

NAME = "merge-all-layers"  # the --compare entry


def merged_layout(layout: CacheLayout) -> CacheLayout:
    """One cache layer read by every model layer; the layers must share one spec (a model
    mixing sliding-window and global layers cannot store them as one). The rest of the layout
    (the longest a sequence may be) stays."""
    require(len(set(layout.specs)) == 1, NAME, f"{len(set(layout.specs))} distinct cache layer specs",
            "needs every layer alike (same window, scale and geometry)")
    return replace(layout, layer_to_cache=(0,) * len(layout.layer_to_cache), specs=layout.specs[:1])


class MergedLayersCache:
    """A cache method over a one-layer layout that every model layer reads and writes as
    its own. Everything but the three per-layer calls passes through."""

    def __init__(self, cache: Any) -> None:
        require(cache.layout.num_cache_layers == 1, NAME, cache.layout.num_cache_layers,
                "the wrapped cache must hold exactly one cache layer")
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def fused_decode_target(self, cache_layer: int, meta: Any) -> None:
        """Never: a fused decoder-layer op would write and attend past this wrapper (it maps
        every layer to one; passing the call through would reach the wrong layer)."""
        return None

    def write(self, cache_layer: int, *args: Any) -> None:
        self._cache.write(0, *args)

    def attend(self, cache_layer: int, *args: Any) -> torch.Tensor:
        return self._cache.attend(0, *args)

    def attend_rows(self, cache_layer: int, *args: Any) -> torch.Tensor:
        return self._cache.attend_rows(0, *args)
