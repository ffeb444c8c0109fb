"""Registry of cache methods and parsing of cache specs such as `full` or
`full:storage_dtype=bfloat16,block_size=32` (the CLI's `--cache NAME --cache-opt k=v`)."""

from __future__ import annotations

import dataclasses
import importlib
import typing
from dataclasses import dataclass
from typing import Any

import torch

from kvforge.cache.base import CacheMethod
from kvforge.cache.layout import CacheLayout
from kvforge.errors import ConfigError
from kvforge.sizes import format_bytes, host_memory_bytes


@dataclass(frozen=True)
class _Entry:
    method: type[CacheMethod]
    config: type


_METHODS: dict[str, _Entry] = {}


def register_cache_method(name: str, config: type):
    """Class decorator: make a CacheMethod available under `name` with its config class."""

    def decorate(cls: type[CacheMethod]) -> type[CacheMethod]:
        cls.name = name
        _METHODS[name] = _Entry(cls, config)
        return cls

    return decorate


@dataclass(frozen=True)
class CacheSpec:
    method: str
    options: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        if not self.options:
            return self.method
        return self.method + ":" + ",".join(f"{k}={v}" for k, v in self.options)

    def config(self) -> Any:
        """The method's validated config object built from the options."""
        entry = _entry(self.method)
        return config_from_options(entry.config, dict(self.options), prefix=f"cache {self.method}")


def parse_cache_spec(text: str, extra_options: list[str] | None = None) -> CacheSpec:
    """`name[:k=v,k=v]` plus `k=v` strings from repeated --cache-opt flags."""
    name, _, rest = text.strip().partition(":")
    pairs = [p for p in rest.split(",") if p.strip()] + list(extra_options or [])
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError("cache option", pair, "must be written key=value")
        options[key.strip()] = value.strip()
    _entry(name)
    spec = CacheSpec(name, tuple(sorted(options.items())))
    spec.config()  # validate eagerly
    return spec


def split_spec_list(entries: list[str] | str | None, bare: tuple[str, ...] = ()) -> list[str]:
    """Comma-separated lists of specs (repeated `--compare X,Y` flags) -> one entry per
    spec. A `k=v` piece without a colon continues the previous spec's options
    (`kivi,bits=4` -> `kivi:bits=4`), except after a name in `bare` that takes none."""
    texts = [entries] if isinstance(entries, str) else list(entries or [])
    items: list[str] = []
    for text in texts:
        for piece in (p.strip() for p in text.split(",")):
            if not piece:
                continue
            if "=" in piece and ":" not in piece and items and items[-1] not in bare:
                items[-1] += ("," if ":" in items[-1] else ":") + piece
            else:
                items.append(piece)
    return items


def create_cache(spec: CacheSpec | str, layout: CacheLayout, budget_bytes: int,
                 compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> CacheMethod:
    if isinstance(spec, str):
        spec = parse_cache_spec(spec)
    entry = _entry(spec.method)
    try:
        return entry.method(layout, spec.config(), budget_bytes, compute_dtype, torch.device(device))
    except (MemoryError, RuntimeError) as exc:
        # A budget the device cannot hold fails in the stores' `torch.empty` (or in Python's
        # bookkeeping of its pages): said as a configuration error, not an allocator's
        # traceback. Other RuntimeErrors pass. (torch.OutOfMemoryError is a RuntimeError.)
        if not isinstance(exc, (MemoryError, torch.OutOfMemoryError)) and not _out_of_memory(str(exc)):
            raise
        raise ConfigError("kv_budget", format_bytes(budget_bytes),
                          f"could not be allocated on {torch.device(device)}{_free_memory(torch.device(device))}: "
                          "give a smaller budget") from None


def _out_of_memory(message: str) -> bool:
    """torch's CPU allocator's refusal, or CUDA's raw one (e.g. pinning host memory)."""
    text = message.lower()
    return "can't allocate memory" in text or "out of memory" in text


def _free_memory(device: torch.device) -> str:
    if device.type != "cuda":
        memory = host_memory_bytes()
        known = f": {format_bytes(memory)} of RAM and swap" if memory is not None else ""
        return f" (the host's allocator refused it{known})"
    free, total = torch.cuda.mem_get_info(device)
    return f" ({format_bytes(free)} free of {format_bytes(total)})"


def config_from_options(config_cls: type, options: dict[str, str], prefix: str) -> Any:
    """Build a dataclass config from string options, converting by field type."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix} option", unknown[0], f"known options are {sorted(fields)}")
    values = {key: _convert(f"{prefix} {key}", raw, hints[key]) for key, raw in options.items()}
    return config_cls(**values)


def _convert(parameter: str, raw: str, hint: Any) -> Any:
    args = typing.get_args(hint)
    kinds = [a for a in args if a is not type(None)] if args else [hint]
    if raw.lower() in ("none", "") and type(None) in args:
        return None
    for kind in kinds:
        try:
            if kind is bool:
                if raw.lower() in ("1", "true", "yes", "on"):
                    return True
                if raw.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(raw)
            if kind in (int, float, str):
                return kind(raw)
            if typing.get_origin(kind) is typing.Literal:
                return raw
        except ValueError:
            continue
    raise ConfigError(parameter, raw, f"must be {' or '.join(_KIND_NAMES.get(k, str(k)) for k in kinds)}"
                                      + (" or none" if type(None) in args else ""))


_KIND_NAMES = {int: "an integer", float: "a number", str: "text", bool: "true or false"}


def _entry(name: str) -> _Entry:
    _import_builtin_methods()
    if name not in _METHODS:
        raise ConfigError("cache", name, f"known cache methods are {sorted(_METHODS)}")
    return _METHODS[name]


# One line per built-in method: its package registers it on import.
BUILTIN_METHODS = ("kvforge.cache.full", "kvforge.cache.kivi", "kvforge.cache.shadowkv")


def _import_builtin_methods() -> None:
    # Imported here, not at the top, so each method can import this registry without a cycle.
    for package in BUILTIN_METHODS:
        importlib.import_module(package)
