"""The systems an evaluation runs side by side, parsed from `--cache` and `--compare`.

The convention is `kvforge bench`'s: the configuration under test (`--cache SPEC`
plus `--cache-opt`) comes first, then every `--compare X[,Y...]` entry. An entry is
- a kvforge cache spec: `full`, `full:storage_dtype=bfloat16`, `kivi:bits=4`, ...;
- `hf`: transformers on the same weights with its default DynamicCache;
- `hf-quanto[:bits=2,group=32,residual=128,axis_key=0,axis_value=0]` and `hf-hqq[:...]`:
  transformers' `QuantizedCache` with that backend;
- `hf-kivi[:bits=2,group=32,residual=128]`: transformers with kvforge's `KIVICache`.
A spec's own `k=v` options may continue after commas (`kivi:bits=4,group=64,full`).

Every system is scored on identical samples. The *baseline* of the deltas is the first
compared system that stores K/V in full precision (`full` without a storage dtype, or
`hf`), else the system under test if it is full precision, else the first compared system.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvforge.cache.registry import CacheSpec, config_from_options, parse_cache_spec, split_spec_list
from kvforge.errors import ConfigError, require

SystemKind = Literal["kvforge", "hf"]
HF_CACHES = ("dynamic", "quanto", "hqq", "kivi")


@dataclass(frozen=True)
class HFQuantizedOptions:
    """Options of transformers' QuantizedCache (`hf-quanto`, `hf-hqq`). axis 0 is
    transformers' default for both; quanto accepts 0/-1, HQQ 0/1."""

    bits: int = 4
    group: int = 32
    residual: int = 128
    axis_key: int = 0
    axis_value: int = 0

    def __post_init__(self) -> None:
        require(self.bits in (1, 2, 3, 4, 8), "bits", self.bits, "must be one of [1, 2, 3, 4, 8]")
        require(self.group >= 1, "group", self.group, "must be >= 1")
        require(self.residual >= 0, "residual", self.residual, "must be >= 0")


@dataclass(frozen=True)
class HFKIVIOptions:
    """Options of `hf-kivi` (kvforge.integrations.transformers.KIVICache)."""

    bits: int = 2
    group: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        from kvforge.integrations.transformers import KIVICacheConfig  # validates the same rules

        KIVICacheConfig(self.bits, self.group, self.residual)


_HF_OPTIONS = {"quanto": HFQuantizedOptions, "hqq": HFQuantizedOptions, "kivi": HFKIVIOptions}


@dataclass(frozen=True)
class EvalSystem:
    """One configuration evaluated. kind "kvforge": the engine with `cache`; kind "hf":
    transformers with `hf_cache` ("dynamic", "quanto", "hqq" or "kivi") and its options."""

    name: str
    kind: SystemKind
    cache: CacheSpec | None = None
    hf_cache: str = "dynamic"
    hf_options: HFQuantizedOptions | HFKIVIOptions | None = None
    # kvforge systems: run the --swiftkv model when one is given (False: its base model).
    swiftkv: bool = True

    @property
    def full_precision(self) -> bool:
        if self.kind == "hf":
            return self.hf_cache == "dynamic"
        return self.cache is not None and self.cache.method == "full" and "storage_dtype" not in dict(
            self.cache.options)


def split_entries(entries: list[str] | str | None) -> list[str]:
    """Comma-separated `--compare` values -> entries; a bare `k=v` continues the previous spec."""
    return split_spec_list(entries, bare=("hf", "base"))


def parse_system(entry: str) -> EvalSystem:
    name, _, rest = entry.partition(":")
    if name == "hf":
        require(not rest, "compare", entry, "'hf' takes no options")
        return EvalSystem("hf", "hf")
    if name.startswith("hf-"):
        backend = name[3:]
        require(backend in _HF_OPTIONS, "compare", entry, f"transformers caches are hf, "
                f"{', '.join('hf-' + b for b in _HF_OPTIONS)}")
        options = dict(p.split("=", 1) for p in rest.split(",") if "=" in p)
        bad = [p for p in rest.split(",") if p.strip() and "=" not in p]
        require(not bad, "compare", entry, "options must be written key=value")
        parsed = config_from_options(_HF_OPTIONS[backend], {k.strip(): v.strip() for k, v in options.items()},
                                     prefix=name)
        label = name + "".join(f",{k}={v}" for k, v in sorted(options.items())).replace(",", ":", 1)
        return EvalSystem(label, "hf", hf_cache=backend, hf_options=parsed)
    if name == "base":
        raise ConfigError("compare", entry, "'base' is SwiftKV's base model and needs --swiftkv DIR")
    try:
        spec = parse_cache_spec(entry)
    except ConfigError as exc:
        raise ConfigError("compare", entry, f"each entry must be hf, hf-quanto, hf-hqq, hf-kivi or a cache "
                                            f"spec ({exc})") from exc
    return EvalSystem(f"kvforge[{spec}]", "kvforge", spec)


def parse_systems(cache: str, cache_opt: list[str] | None, compare: list[str] | str | None,
                  swiftkv: str | None = None) -> list[EvalSystem]:
    """[system under test, *compared systems], with distinct names. With `swiftkv` (a
    checkpoint directory) kvforge systems run the SwiftKV model, and `base` runs its base
    model with the cache under test."""
    under_test = parse_cache_spec(cache, list(cache_opt or []))
    prefix = "swiftkv" if swiftkv else "kvforge"
    systems = [EvalSystem(f"{prefix}[{under_test}]", "kvforge", under_test)]
    for entry in split_entries(compare):
        if entry == "base" and swiftkv:
            systems.append(EvalSystem(f"base[{under_test}]", "kvforge", under_test, swiftkv=False))
            continue
        system = parse_system(entry)
        if system.kind == "kvforge" and swiftkv:
            system = EvalSystem(f"{prefix}[{system.cache}]", "kvforge", system.cache)
        systems.append(system)
    seen: dict[str, int] = {}
    out = []
    for system in systems:
        seen[system.name] = seen.get(system.name, 0) + 1
        count = seen[system.name]
        out.append(system if count == 1 else EvalSystem(f"{system.name}#{count}", system.kind, system.cache,
                                                        system.hf_cache, system.hf_options, system.swiftkv))
    return out


def check_backends(systems: list[EvalSystem], compare: list[str] | str | None, model: str | None = None) -> None:
    """Refuse, before anything loads, a system whose optional backend is not installed, or
    (given the `model`) that transformers refuses for that model: it would otherwise fail
    after every system before it had run."""
    from kvforge.preflight import require_backend

    entries = split_entries(compare)
    quantized = [s for s in systems if s.hf_cache in ("quanto", "hqq")]
    for system in quantized:
        entry = next((e for e in entries if e.startswith(f"hf-{system.hf_cache}")), system.name)
        require_backend(system.hf_cache, "compare", entry)
    if quantized and model is not None:
        from kvforge.config import SLIDING_ATTENTION
        from kvforge.models.loader import load_model_config, resolve_model_source

        if SLIDING_ATTENTION in load_model_config(resolve_model_source(model)).layer_types:
            entry = next((e for e in entries if e.startswith("hf-quanto") or e.startswith("hf-hqq")),
                         quantized[0].name)
            raise ConfigError("compare", entry, f"needs a model whose layers are all full attention: transformers' "
                              f"QuantizedCache refuses sliding-window layers, which {model} has")


def baseline_index(systems: list[EvalSystem], requested: str | None = None) -> int:
    """Index of the baseline (see the module docstring); `requested` names one explicitly."""
    if requested:
        # A system is named by its display name or by its cache spec; when two systems share
        # a spec, the spec names the first of them (display names stay unique).
        aliases = {s.name: i for i, s in enumerate(systems)}
        for i, s in enumerate(systems):
            if s.cache is not None:
                aliases.setdefault(str(s.cache), i)
        require(requested in aliases, "baseline", requested, f"must be one of {sorted(aliases)}")
        return aliases[requested]
    for index, system in enumerate(systems[1:], start=1):
        if system.full_precision:
            return index
    return 1 if len(systems) > 1 and not systems[0].full_precision else 0
