"""How a SwiftKV model's KV cache maps onto vLLM attention layers (pure Python).

vLLM allocates KV cache for every `Attention` module that has no
`kv_sharing_target_layer_name`. The plugin creates:

- layers 0 .. l-1: vLLM's ordinary Llama attention, `model.layers.N.self_attn.attn`,
  each owning a cache layer;
- one cache-owner `Attention` per AcrossKV group, `model.swiftkv_caches.{L + j}.attn`
  (j = group index). The model writes the group's K/V into it (from norm_swiftkv of
  layer l-1's output, for every token); it never attends. Its index L + j lies past
  the decoder's layers so every allocated cache layer has its own layer index;
- every later layer N >= l: `model.layers.N.self_attn.attn` with
  `kv_sharing_target_layer_name` = its group's owner, so it allocates nothing.

vLLM therefore allocates l + (L - l) / g cache layers, as kvforge's CacheLayout does.

Invariant (construction order = registration order in vLLM's forward context): all owners
are created before any later layer's attention, so the later layers are exactly the
trailing run of KV-sharing layers that `kv_sharing_fast_prefill` restricts to the rows
that need logits.

Pipeline parallelism (`pipeline_stage`): a stage holds decoder layers [start, end). vLLM
shares a KV cache only between attention layers of one stage (each stage's worker
allocates the caches of its own layers), and every owner is written from layer l-1's
output by one GEMM, so the GEMM, the owners and all later layers sit on one stage, which
ends at L and is therefore the last: its first layer must be <= l. Earlier stages hold
early layers only and hand on (hidden states, residual) as vLLM's Llama stages do.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.config import SwiftKVConfig
from kvforge.errors import require

CACHE_OWNERS = "swiftkv_caches"


@dataclass(frozen=True)
class SwiftKVCacheLayout:
    num_layers: int
    swift: SwiftKVConfig
    prefix: str = "model"

    def __post_init__(self) -> None:
        self.swift.check_layers(self.num_layers)

    @property
    def first_later(self) -> int:
        return self.swift.num_key_value_layers

    @property
    def num_groups(self) -> int:
        return (self.num_layers - self.first_later) // self.swift.key_value_group_size

    @property
    def num_kv_cache_layers(self) -> int:
        """Layers vLLM allocates KV cache for: l + (L - l) / g."""
        return self.first_later + self.num_groups

    def group_of(self, layer: int) -> int:
        """AcrossKV group of a later layer (ValueError for an early layer)."""
        if not self.swift.is_later(layer) or layer >= self.num_layers:
            raise ValueError(f"layer {layer} is not a later layer (l={self.first_later}, L={self.num_layers})")
        return (layer - self.first_later) // self.swift.key_value_group_size

    def owner_module(self, group: int) -> str:
        """Module path of group `group`'s cache owner (its Attention is `.attn` below it)."""
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group {group} out of range [0, {self.num_groups})")
        return f"{self.prefix}.{CACHE_OWNERS}.{self.num_layers + group}"

    def owner_layer_name(self, group: int) -> str:
        return self.owner_module(group) + ".attn"

    def layer_attention_name(self, layer: int) -> str:
        return f"{self.prefix}.layers.{layer}.self_attn.attn"

    def kv_sharing_target(self, layer: int) -> str | None:
        """The attention layer whose cache `layer` reads: None (its own) for layer < l."""
        if not self.swift.is_later(layer):
            return None
        return self.owner_layer_name(self.group_of(layer))

    def attention_names_in_order(self) -> list[str]:
        """Attention layer names in the order the model must create them."""
        early = [self.layer_attention_name(i) for i in range(self.first_later)]
        owners = [self.owner_layer_name(j) for j in range(self.num_groups)]
        later = [self.layer_attention_name(i) for i in range(self.first_later, self.num_layers)]
        return early + owners + later

    def capacity_ratio_vs_base(self) -> float:
        """KV cache tokens per byte relative to the base model (all L layers cached)."""
        return self.num_layers / self.num_kv_cache_layers

    def check_pipeline_split(self, last_stage_start: int, size: int) -> None:
        """ConfigError unless the last of `size` stages, starting at layer
        `last_stage_start`, holds every later layer (nothing to hold when l = L)."""
        require(self.num_groups == 0 or last_stage_start <= self.first_later, "num_key_value_layers",
                self.first_later,
                f"pipeline_parallel_size={size} starts the last stage at layer {last_stage_start}; SwiftKV's "
                f"later layers, their cache owners and the GEMM writing them must share one stage, so the last "
                f"stage must start at or before layer num_key_value_layers (set VLLM_PP_LAYER_PARTITION so "
                f"that it does, or use a smaller pipeline_parallel_size)")

    def pipeline_stage(self, start: int, end: int, rank: int, size: int,
                       last_stage_start: int) -> SwiftKVStage:
        """Stage `rank` of `size`, holding layers [start, end) of vLLM's split whose last
        stage starts at `last_stage_start`; ConfigError when the split puts a later layer
        on any stage but the last (see the module docstring)."""
        require(0 <= rank < size, "pipeline rank", rank, f"must be in [0, pipeline_parallel_size={size})")
        require(0 <= start < end <= self.num_layers, "pipeline stage layers", (start, end),
                f"must be a non-empty range within [0, {self.num_layers})")
        self.check_pipeline_split(last_stage_start, size)
        is_last = rank == size - 1
        require(is_last == (end == self.num_layers) and (not is_last or start == last_stage_start),
                "pipeline stage layers", (start, end),
                f"stage {rank} of {size} must end at layer {self.num_layers} exactly when it is the last, "
                f"and the last must start at {last_stage_start}")
        return SwiftKVStage(start, end, rank == 0, is_last, self.first_later)


@dataclass(frozen=True)
class SwiftKVStage:
    """The decoder layers [start, end) one pipeline stage runs. Only the last stage holds
    later layers (and the owners, the fused GEMM, the final norm); an earlier stage's
    layers are all early ones (SwiftKVCacheLayout.pipeline_stage checks the split)."""

    start: int
    end: int
    is_first: bool
    is_last: bool
    first_later: int

    @property
    def early(self) -> range:
        """The early (ordinary Llama) layers this stage runs."""
        return range(self.start, min(self.end, self.first_later))

    @property
    def holds_later(self) -> bool:
        return self.is_last and self.first_later < self.end

    def runs(self, layer: int) -> bool:
        return self.start <= layer < self.end
