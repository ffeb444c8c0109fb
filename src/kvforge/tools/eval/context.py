"""What every evaluation shares: the models (loaded once, on first use), fresh caches per
system, and transformers caches for the `hf*` systems.

kvforge systems share one kvforge model; each gets a new cache of `--kv-budget` bytes
(untouched pages cost no RAM). `hf*` systems share one transformers model on the same
weights, loaded only when such a system runs. Every model and cache is on `device`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.cache.registry import create_cache
from kvforge.engine.runner import ModelRunner
from kvforge.models.loader import ModelSource, load_model, resolve_model_source
from kvforge.models.tokenizer import load_tokenizer
from kvforge.tools.eval.compare import EvalSystem, HFKIVIOptions, HFQuantizedOptions


def log(message: str) -> None:
    print(f"[eval] {message}", file=sys.stderr, flush=True)


def load_kvforge(model: str, dtype: torch.dtype, swiftkv: str | None = None,
                 device: str = "cpu") -> tuple[torch.nn.Module, Any, ModelSource]:
    """kvforge model, tokenizer and source (tests replace this with tiny models)."""
    net, source = load_model(model, dtype=dtype, swiftkv=swiftkv, device=device)
    return net, _tokenizer_of(source), source


def load_tokenizer_only(model: str) -> Any:
    """The model's tokenizer without its weights (tests replace this too)."""
    return _tokenizer_of(resolve_model_source(model))


_tokenizers: dict[tuple[str, str], Any] = {}


def _tokenizer_of(source: ModelSource) -> Any:
    """One tokenizer per file in this process: an evaluation reads it before the weights (to
    build and check its prompts) and again with them, and gemma3-270m's takes 4 s to load."""
    key = (source.kind, str(source.path))
    if key not in _tokenizers:
        _tokenizers[key] = load_tokenizer(source)
    return _tokenizers[key]


def load_hf(source: ModelSource, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """The transformers model on the same weights (tests replace this too)."""
    from kvforge.tools.bench.hf_peer import load_hf_peer

    return load_hf_peer(source, dtype, device)


@dataclass
class EvalContext:
    model_name: str
    dtype: torch.dtype
    kv_budget: int
    swiftkv: str | None = None  # SwiftKV checkpoint laid over the model for kvforge systems
    device: str = "cpu"  # of every model and cache, transformers' included
    _kvforge: dict[bool, tuple[Any, Any, ModelSource]] = field(default_factory=dict, repr=False)
    _hf: torch.nn.Module | None = field(default=None, repr=False)
    _tokenizer: Any = field(default=None, repr=False)

    def kvforge(self, swiftkv: bool = True) -> tuple[Any, Any]:
        """(model, tokenizer), loaded on first use: the --swiftkv model unless `swiftkv` is
        False or none was given (then the base model)."""
        key = swiftkv and self.swiftkv is not None
        if key not in self._kvforge:
            start = time.perf_counter()
            extra = {"swiftkv": self.swiftkv} if key else {}
            self._kvforge[key] = load_kvforge(self.model_name, self.dtype, device=self.device, **extra)
            log(f"kvforge {'SwiftKV ' if key else ''}model loaded ({time.perf_counter() - start:.1f} s)")
        return self._kvforge[key][0], self._kvforge[key][1]

    @property
    def tokenizer(self) -> Any:
        """The tokenizer; loaded alone (no weights) when no model is loaded yet, so prompts
        can be built and checked before minutes of loading."""
        if self._kvforge:
            return next(iter(self._kvforge.values()))[1]
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer_only(self.model_name)
        return self._tokenizer

    def context_length(self) -> int:
        """The model's context in tokens, from its config alone."""
        from kvforge.preflight import model_context

        return model_context(self.model_name, self.swiftkv)

    @property
    def source(self) -> ModelSource:
        if self._kvforge:
            return next(iter(self._kvforge.values()))[2]
        return resolve_model_source(self.model_name)

    def runner(self, system: EvalSystem) -> ModelRunner:
        """A runner with a fresh cache for a kvforge system."""
        model, _ = self.kvforge(system.swiftkv)
        return ModelRunner(model, create_cache(system.cache, model.cache_layout(), self.kv_budget, self.dtype,
                                               self.device))

    def hf_model(self) -> torch.nn.Module:
        if self._hf is None:
            start = time.perf_counter()
            self._hf = load_hf(self.source, self.dtype, self.device)
            log(f"transformers model loaded ({time.perf_counter() - start:.1f} s)")
        return self._hf

    def release_hf(self) -> None:
        self._hf = None


def make_hf_cache(system: EvalSystem, model: torch.nn.Module) -> Any:
    """A fresh transformers cache for one forward sequence of an `hf*` system."""
    from transformers import DynamicCache, QuantizedCache

    if system.hf_cache == "dynamic":
        return DynamicCache(config=model.config)
    options = system.hf_options
    if system.hf_cache == "kivi":
        from kvforge.integrations.transformers import KIVICache

        assert isinstance(options, HFKIVIOptions)
        return KIVICache(bits=options.bits, group=options.group, residual=options.residual, config=model.config)
    assert isinstance(options, HFQuantizedOptions)
    return QuantizedCache(backend=system.hf_cache, config=model.config, nbits=options.bits,
                          q_group_size=options.group, residual_length=options.residual,
                          axis_key=options.axis_key, axis_value=options.axis_value)


def describe_system(system: EvalSystem) -> dict[str, Any]:
    """JSON description of a system (its effective options)."""
    out: dict[str, Any] = {"name": system.name, "kind": system.kind}
    if system.kind == "kvforge":
        out["cache"] = str(system.cache)
    else:
        out["hf_cache"] = system.hf_cache
        if system.hf_options is not None:
            out["hf_options"] = vars(system.hf_options).copy()
    return out
