"""Which cache layers a model has, and which model layers read them.

A model declares its layout once; cache methods size their storage from it. The
indirection exists for SwiftKV/AcrossKV, where several model layers read one cache layer
and the cache therefore holds fewer layers than the model.

Invariants:
- every model layer reads exactly one cache layer (`layer_to_cache[i]`);
- every cache layer is read by at least one model layer;
- all cache layers share one geometry (kv heads, head_dim), so storage can be pooled;
- no sequence holds more than `max_sequence_tokens` tokens (the model's maximum length, or
  the engine's `max_model_len`; None: unbounded), so a method may size a store for at most
  one sequence that long.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.errors import ConfigError, require


@dataclass(frozen=True)
class CacheLayerSpec:
    num_kv_heads: int
    head_dim: int
    scale: float  # multiplier of q.k inside softmax
    # A query at position p sees keys p-window+1 .. p; None means all earlier keys.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        require(self.num_kv_heads > 0, "num_kv_heads", self.num_kv_heads, "must be > 0")
        require(self.head_dim > 0, "head_dim", self.head_dim, "must be > 0")
        require(self.sliding_window is None or self.sliding_window > 0, "sliding_window",
                self.sliding_window, "must be None or > 0")


@dataclass(frozen=True)
class CacheLayout:
    layer_to_cache: tuple[int, ...]
    specs: tuple[CacheLayerSpec, ...]
    max_sequence_tokens: int | None = None

    def __post_init__(self) -> None:
        require(self.max_sequence_tokens is None or self.max_sequence_tokens >= 1, "max_sequence_tokens",
                self.max_sequence_tokens, "must be None or >= 1")
        read = set(self.layer_to_cache)
        if read != set(range(len(self.specs))):
            raise ConfigError("layer_to_cache", self.layer_to_cache,
                              f"must reference every cache layer 0..{len(self.specs) - 1} and no other")
        geometry = {(s.num_kv_heads, s.head_dim) for s in self.specs}
        require(len(geometry) == 1, "cache layer geometry", sorted(geometry),
                "all cache layers must share num_kv_heads and head_dim")

    @property
    def num_cache_layers(self) -> int:
        return len(self.specs)

    @property
    def num_kv_heads(self) -> int:
        return self.specs[0].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.specs[0].head_dim

    @classmethod
    def one_per_layer(cls, specs: list[CacheLayerSpec]) -> CacheLayout:
        return cls(layer_to_cache=tuple(range(len(specs))), specs=tuple(specs))
