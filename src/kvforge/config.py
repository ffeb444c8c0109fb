"""Model configuration: one validated dataclass for every supported decoder.

`kvforge.models.hf_config.config_from_hf_dict` builds it from a Hugging Face `config.json`
(each model family parses its own part, models/family.py); the GGUF loader goes through the
same function. Everything downstream (models, cache layout, memory accounting) reads only
this. It knows no family by name: `architecture` names a registered family, checked where
the registry is known (building a model, reading a config.json).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvforge.errors import ConfigError, require

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

RopeType = Literal["default", "linear", "llama3"]
EARLY_EXIT_KEY = "early_exit_head"  # kvforge's config.json key (the authors' format has none)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters of one attention kind (global or local layers)."""

    theta: float
    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        require(self.theta > 0, "rope_theta", self.theta, "must be > 0")
        require(self.rope_type in ("default", "linear", "llama3"), "rope_type", self.rope_type,
                "supported RoPE types are default, linear and llama3")
        require(self.factor >= 1.0 or self.rope_type == "default", "rope_scaling.factor", self.factor,
                "must be >= 1")
        if self.rope_type == "llama3":
            require(self.high_freq_factor > self.low_freq_factor, "rope_scaling.high_freq_factor",
                    self.high_freq_factor, "must be greater than low_freq_factor")

    @classmethod
    def from_hf(cls, theta: float, scaling: dict[str, Any] | None) -> RopeConfig:
        if not scaling:
            return cls(theta=float(theta))
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ConfigError("rope_scaling.rope_type", rope_type,
                              "supported RoPE types are default, linear and llama3")
        if rope_type == "default":
            return cls(theta=float(theta))
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class SwiftKVConfig:
    """SwiftKV wiring of a decoder (Qiao et al.): layers >= `num_key_value_layers` (l) get
    their K/V from layer l's input through `norm_swiftkv` (SingleInputKV), and groups of
    `key_value_group_size` (g) consecutive later layers share one K/V (AcrossKV).

    Cache layers: model layers < l own one each; later layer i reads cache layer
    l + (i - l) // g, written by its group leader (the first layer of the group)."""

    num_key_value_layers: int
    key_value_group_size: int = 1
    # Early-exit head (paper App. E) on the input h_l of layer l: logits of
    # final_norm(early_exit_proj(h_l)) through the model's own vocabulary head (shared, frozen
    # in training): an H x H projection instead of a second head. (No norm of its own before
    # the projection: the final RMSNorm after it is scale-invariant, so one would be redundant.)
    early_exit_head: bool = False

    def __post_init__(self) -> None:
        require(isinstance(self.num_key_value_layers, int) and self.num_key_value_layers >= 1,
                "num_key_value_layers", self.num_key_value_layers, "must be an integer >= 1")
        require(isinstance(self.key_value_group_size, int) and self.key_value_group_size >= 1,
                "key_value_group_size", self.key_value_group_size, "must be an integer >= 1")

    def check_layers(self, num_layers: int) -> None:
        kv_layers, g = self.num_key_value_layers, self.key_value_group_size
        require(1 <= kv_layers <= num_layers, "num_key_value_layers", kv_layers,
                f"must be in [1, num_layers={num_layers}]")
        require((num_layers - kv_layers) % g == 0, "key_value_group_size", g,
                f"must divide the number of later layers num_layers - num_key_value_layers = "
                f"{num_layers} - {kv_layers} = {num_layers - kv_layers}")

    def check_layer_types(self, layer_types: tuple[str, ...]) -> None:
        """Every AcrossKV group is of one attention kind: its layers read the cache layer
        its leader writes, whose window and RoPE the leader's kind decides, so each later
        layer keeps its own window rule only if its group shares it."""
        g = self.key_value_group_size
        for leader in self.leaders(len(layer_types)):
            kinds = layer_types[leader:leader + g]
            require(len(set(kinds)) == 1, "key_value_group_size", g,
                    f"an AcrossKV group must not mix sliding-window and global layers: layers "
                    f"{leader}..{leader + g - 1} are {list(kinds)}")

    def is_later(self, layer: int) -> bool:
        return layer >= self.num_key_value_layers

    def is_leader(self, layer: int) -> bool:
        """Later layers whose k/v_proj_swiftkv produce their group's K/V."""
        return self.is_later(layer) and (layer - self.num_key_value_layers) % self.key_value_group_size == 0

    def leaders(self, num_layers: int) -> range:
        return range(self.num_key_value_layers, num_layers, self.key_value_group_size)

    def cache_layer_of(self, layer: int) -> int:
        first = self.num_key_value_layers
        return layer if layer < first else first + (layer - first) // self.key_value_group_size

    def num_cache_layers(self, num_layers: int) -> int:
        first = self.num_key_value_layers
        return first + (num_layers - first) // self.key_value_group_size

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> SwiftKVConfig | None:
        """The SwiftKV fields of a `<family>_swiftkv` config.json (None when `swiftkv` is false)."""
        if not config.get("swiftkv", True):
            return None
        layers = config.get("num_key_value_layers")
        if layers is None:
            raise ConfigError("num_key_value_layers", None, "a SwiftKV config with swiftkv=true needs it")
        return cls(num_key_value_layers=int(layers),
                   key_value_group_size=int(config.get("key_value_group_size") or 1),
                   early_exit_head=bool(config.get(EARLY_EXIT_KEY, False)))


@dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of a decoder-only model. Validated on construction."""

    architecture: str  # a registered model family (models/family.py): "llama", "gemma3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    model_type: str = "llama"
    # Rotary parameters of sliding-window layers when they differ (Gemma3's local base).
    local_rope: RopeConfig | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2, some Llamas)
    attention_out_bias: bool = False  # bias on o_proj (Llama's attention_bias; not Qwen2)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # One entry per layer, FULL_ATTENTION or SLIDING_ATTENTION; empty means all full.
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None
    # Gemma-style (1 + w) RMSNorm of each query and key head before RoPE (Gemma3)
    qk_norm: bool = False
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    swiftkv: SwiftKVConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        require(isinstance(self.architecture, str) and self.architecture != "", "architecture", self.architecture,
                "must name a model family")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, name, value, "must be a positive integer")
        require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", self.num_kv_heads,
                f"must divide num_heads={self.num_heads} (grouped-query attention)")
        require(self.head_dim % 2 == 0, "head_dim", self.head_dim, "must be even for rotary embeddings")
        require(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "must be > 0")
        require(self.hidden_act in ("silu", "gelu_pytorch_tanh"), "hidden_act", self.hidden_act,
                "supported activations are silu and gelu_pytorch_tanh")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        require(len(self.layer_types) == self.num_layers, "layer_types", len(self.layer_types),
                f"must have one entry per layer (num_layers={self.num_layers})")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        require(not bad, "layer_types", bad[:1], f"entries must be one of {LAYER_TYPES}")
        if SLIDING_ATTENTION in self.layer_types:
            require(self.sliding_window is not None and self.sliding_window > 0, "sliding_window",
                    self.sliding_window, "must be a positive integer when a layer uses sliding attention")
        if self.query_pre_attn_scalar is not None:
            require(self.query_pre_attn_scalar > 0, "query_pre_attn_scalar", self.query_pre_attn_scalar,
                    "must be > 0")
        if self.swiftkv is not None:
            self.swiftkv.check_layers(self.num_layers)
            self.swiftkv.check_layer_types(self.layer_types)

    # ----------------------------------------------------------------------------------
    @property
    def attention_scale(self) -> float:
        """Multiplier of q.k: query_pre_attn_scalar^-0.5 (Gemma) or head_dim^-0.5."""
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(base) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING_ATTENTION

    def window_of(self, layer: int) -> int | None:
        """Sliding window of a layer (a query sees itself and window-1 earlier keys) or None."""
        return self.sliding_window if self.is_sliding(layer) else None

    def rope_of(self, layer: int) -> RopeConfig:
        if self.is_sliding(layer) and self.local_rope is not None:
            return self.local_rope
        return self.rope
