"""One registry entry per model family: everything kvforge knows about a family beside its
layer code, so adding a family is one module (its layers, its CausalLM, its entry) plus one
line in `BUILTIN_FAMILIES`.

An entry states
- which Hugging Face `model_type`s it reads, and how the family's part of a config.json
  becomes ModelConfig fields (`hf_fields`; the shape fields every family shares are read
  once, in models/hf_config.py);
- its CausalLM and, when it has one, its SwiftKV CausalLM;
- the config.json layouts it writes (SwiftKV checkpoints): each layout's `model_type`,
  its `architectures` names, which layout states a given config and the family's fields in
  it (the inverse of `hf_fields`). A family reads `<layout>_swiftkv` exactly for the layouts
  it writes (the authors' naming rule);
- its llama.cpp GGUF architectures: tensor names, what the converter did to the weights
  (Q/K row permutation, norm weights stored with an offset) and the config fields GGUF
  implies.

A built-in family's module defines `FAMILY` and is named in `BUILTIN_FAMILIES`: the registry
imports them on the first lookup (as cache/registry.py does for cache methods) and always
lists them first, in that order. A family defined elsewhere registers itself with
`register_family`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvforge.config import ModelConfig
from kvforge.errors import ConfigError

if TYPE_CHECKING:
    from kvforge.models.causal_lm import CausalLM
    from kvforge.models.gguf_metadata import GGUFMetadata

SWIFTKV_SUFFIX = "_swiftkv"


@dataclass(frozen=True)
class HFLayout:
    """One config.json layout a family writes: its base `model_type` and the
    `architectures` entries of plain and SwiftKV checkpoints. SwiftKV checkpoints are
    `<model_type>_swiftkv`."""

    model_type: str
    architecture: str
    swiftkv_architecture: str

    @property
    def swiftkv_model_type(self) -> str:
        return self.model_type + SWIFTKV_SUFFIX


# llama.cpp's block tensor names that every family here shares -> Hugging Face module paths
# inside `model.layers.N`.
GGUF_COMMON_BLOCK_NAMES: Mapping[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}


@dataclass(frozen=True)
class GGUFArchitecture:
    """A llama.cpp `general.architecture` a family reads.

    `add_config(meta, config)` fills the config.json-style dict with what GGUF states or
    implies for the family beyond the shared fields (sliding window, Gemma3's defaults).
    The weights the converter changed are restored from data: `permuted_qk` (Q/K rows
    interleaved per head for the llama converter), `norm_weight_offset` (every
    `*norm.weight` stored as HF weight + offset: Gemma's 1 + w)."""

    name: str
    model_type: str  # the HF model_type the file's config reads as
    block_names: Mapping[str, str]  # blk.N.<part> -> HF path inside model.layers.N
    add_config: Callable[[GGUFMetadata, dict[str, Any]], None]
    permuted_qk: bool = False
    norm_weight_offset: float = 0.0


@dataclass(frozen=True)
class ModelFamily:
    """A decoder family: `name` is `ModelConfig.architecture`."""

    name: str
    model_types: tuple[str, ...]  # config.json model_types read (SwiftKV ones follow from `hf_layouts`)
    # (config.json dict, its model_type without `_swiftkv`) -> ModelConfig fields beyond the shared
    # shape fields (they may override those, e.g. a family default of max_position_embeddings)
    hf_fields: Callable[[dict[str, Any], str], dict[str, Any]]
    causal_lm: type[CausalLM]
    swiftkv_causal_lm: type[CausalLM] | None
    hf_layouts: tuple[HFLayout, ...]
    # the layout (a model_type of `hf_layouts`) whose fields state a config; ConfigError if none
    hf_layout_of: Callable[[ModelConfig], str]
    # (config, layout model_type) -> the family's config.json fields, read back by `hf_fields`
    hf_fields_of: Callable[[ModelConfig, str], dict[str, Any]]
    gguf_architectures: tuple[GGUFArchitecture, ...] = ()
    # a wrapper model_type whose config.json nests the decoder under `text_config` -> the
    # model_type that nested config has when it names none (multimodal Gemma3)
    text_config_model_types: Mapping[str, str] = field(default_factory=dict)

    @property
    def swiftkv_model_types(self) -> tuple[str, ...]:
        if self.swiftkv_causal_lm is None:
            return ()
        return tuple(layout.swiftkv_model_type for layout in self.hf_layouts)

    def layout(self, model_type: str) -> HFLayout:
        return next(layout for layout in self.hf_layouts if layout.model_type == model_type)

    def model_class(self, swiftkv: bool) -> type[CausalLM]:
        if not swiftkv:
            return self.causal_lm
        if self.swiftkv_causal_lm is None:
            raise ConfigError("swiftkv", self.name, "this model family has no SwiftKV variant")
        return self.swiftkv_causal_lm


_FAMILIES: dict[str, ModelFamily] = {}

# One line per built-in family: a module defining `FAMILY`.
BUILTIN_FAMILIES = ("kvforge.models.llama_family", "kvforge.models.gemma3_family")


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` known by its name, its model_types and its GGUF architectures, none of
    which another family may already claim (registering the same entry again is a no-op)."""
    _import_builtin_families()
    if _FAMILIES.get(family.name) is not family:
        _add(family)
    return family


def _add(family: ModelFamily) -> None:
    taken = {family.name} & set(_FAMILIES)
    taken |= set(_model_types(family)) & {t for known in _FAMILIES.values() for t in _model_types(known)}
    taken |= {g.name for g in family.gguf_architectures} & {g.name for known in _FAMILIES.values()
                                                            for g in known.gguf_architectures}
    if taken:
        raise ConfigError("model family", family.name, f"must not claim names another family holds: {sorted(taken)}")
    _FAMILIES[family.name] = family


def families() -> tuple[ModelFamily, ...]:
    _import_builtin_families()
    return tuple(_FAMILIES.values())


def family_named(name: str) -> ModelFamily:
    _import_builtin_families()
    if name not in _FAMILIES:
        raise ConfigError("architecture", name, f"known model families are {sorted(_FAMILIES)}")
    return _FAMILIES[name]


def family_of(config: ModelConfig) -> ModelFamily:
    return family_named(config.architecture)


def _model_types(family: ModelFamily) -> tuple[str, ...]:
    return family.model_types + family.swiftkv_model_types


def model_type_index() -> dict[str, ModelFamily]:
    """Every config.json model_type read (SwiftKV ones included) -> its family."""
    return {model_type: family for family in families() for model_type in _model_types(family)}


def family_of_model_type(model_type: Any) -> ModelFamily:
    index = model_type_index()
    if model_type not in index:
        raise ConfigError("model_type", model_type, f"supported model types are {sorted(index)}")
    return index[model_type]


def swiftkv_model_types() -> list[str]:
    return sorted(t for family in families() for t in family.swiftkv_model_types)


def gguf_index() -> dict[str, GGUFArchitecture]:
    """GGUF `general.architecture` -> what kvforge knows of it, in registration order."""
    return {g.name: g for family in families() for g in family.gguf_architectures}


def _import_builtin_families() -> None:
    # Imported here, not at the top, so each family module can import this one without a
    # cycle; added before any family registered from elsewhere (register_family calls this first).
    for module in BUILTIN_FAMILIES:
        family = importlib.import_module(module).FAMILY
        if family.name not in _FAMILIES:
            _add(family)
