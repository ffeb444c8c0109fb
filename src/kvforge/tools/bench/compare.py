"""`--compare`: the systems a benchmark measures beside the one under test."""

from __future__ import annotations

from pathlib import Path

from kvforge.cache.registry import CacheSpec, parse_cache_spec, split_spec_list
from kvforge.errors import ConfigError, require
from kvforge.tools.bench import llamacpp_option
from kvforge.tools.bench.merge_all_layers import NAME as MERGE_ALL_LAYERS
from kvforge.tools.bench.systems import System, kvforge_name

NO_PREFIX_CACHING = "no-prefix-caching"  # --compare: the system under test without prefix caching
EAGER = "eager"  # --compare: the system under test without CUDA graphs (--enforce-eager)
VLLM_PEER = "vllm"  # --compare: vLLM's server of the same weights (bench serve; serve_vllm.py)
HF_STATIC = "hf-static"  # --compare: transformers' static cache, compiled (bench decode/prefill; hf_static_peer.py)


def allowed_entries(llama_cpp: bool, vllm: bool, hf_static: bool, server: bool) -> list[str]:
    """The bare `--compare` words a benchmark takes, for its error messages: `server` (bench
    serve) drops the systems kvforge serve cannot run (transformers, merge-all-layers)."""
    words = [] if server else ["hf"]
    words += [HF_STATIC] * hf_static + ["base", NO_PREFIX_CACHING, EAGER]
    words += [] if server else [MERGE_ALL_LAYERS]
    return words + [f"{llamacpp_option.PEER}[:WEIGHTS]"] * llama_cpp + [VLLM_PEER] * vllm


def parse_compare(entries: list[str] | str | None, under_test: CacheSpec | None = None,
                  swiftkv: str | None = None, llama_cpp: bool = False, vllm: bool = False,
                  hf_static: bool = False, server: bool = False) -> list[System]:
    """`--compare` values -> systems. Each value is a comma-separated list of `hf`,
    `hf-static` (only where `hf_static` says the benchmark has that peer), `base`
    (the --swiftkv model's base model with the cache under test), `merge-all-layers` (the
    base model with the cache under test, one cache layer for all: merge_all_layers.py),
    `llama.cpp[:WEIGHTS]` (only where `llama_cpp` says the benchmark has that peer), `vllm`
    (vLLM's server: only where `vllm` says so, `bench serve`) or cache
    specs; a spec's own `k=v` options may continue after commas
    (`full:storage_dtype=bfloat16,block_size=32`). `server` (bench serve) refuses `hf` and
    `merge-all-layers`, which kvforge serve has no way to run. With --swiftkv, cache-spec systems run
    the SwiftKV model too; `SPEC@DIR` runs the SwiftKV checkpoint DIR, `SPEC@base` the base
    model, whatever --swiftkv says."""
    items = split_spec_list(entries, bare=("hf", HF_STATIC, "base", NO_PREFIX_CACHING, EAGER, MERGE_ALL_LAYERS,
                                           llamacpp_option.PEER, VLLM_PEER))
    allowed = allowed_entries(llama_cpp, vllm, hf_static, server)
    systems = []
    for item in items:
        if item == "hf":
            require(not server, "compare", item, "transformers has no server: compare kvforge systems, or run "
                                                 "another server yourself and measure it with --base-url")
            systems.append(System("hf", "hf"))
        elif item == HF_STATIC:
            require(hf_static, "compare", item, "transformers' static cache with torch.compile is a peer of "
                                                "bench decode and bench prefill only")
            systems.append(System(HF_STATIC, HF_STATIC))
        elif item == VLLM_PEER:
            require(vllm, "compare", item, "vLLM is a peer of `bench serve` only (a server)")
            systems.append(System("vllm", "vllm"))
        elif llamacpp_option.is_peer(item):
            weights = llamacpp_option.parse(item, allowed=llama_cpp)
            systems.append(System(llamacpp_option.system_name(weights), "llama.cpp", weights=weights))
        elif item == NO_PREFIX_CACHING:
            spec = under_test or parse_cache_spec("full")
            systems.append(System(f"{kvforge_name(spec, swiftkv)}, no prefix caching", "kvforge", spec,
                                  prefix_caching=False))
        elif item == EAGER:
            spec = under_test or parse_cache_spec("full")
            systems.append(System(f"{kvforge_name(spec, swiftkv)}, eager", "kvforge", spec, enforce_eager=True))
        elif item == "base":
            if swiftkv is None:
                raise ConfigError("compare", item, "'base' is SwiftKV's base model and needs --swiftkv DIR")
            spec = under_test or parse_cache_spec("full")
            systems.append(System(f"base[{spec}]", "kvforge", spec, swiftkv=False))
        elif item == MERGE_ALL_LAYERS:
            require(not server, "compare", item,
                    "merge-all-layers is a bench throughput/decode system; kvforge serve has no such option")
            spec = under_test or parse_cache_spec("full")
            systems.append(System(f"{MERGE_ALL_LAYERS}[{spec}]", "kvforge", spec, swiftkv=False, merge_all_layers=True))
        else:
            systems.append(_cache_system(item, swiftkv, allowed))
    return systems


def _cache_system(item: str, swiftkv: str | None, allowed: list[str]) -> System:
    """A `SPEC`, `SPEC@DIR` (the SwiftKV checkpoint DIR) or `SPEC@base` (the base model) entry."""
    text, at, where = item.partition("@")
    require(not at or bool(where.strip()), "compare", item, "SPEC@ must name a SwiftKV checkpoint directory or base")
    try:
        spec = parse_cache_spec(text)
    except ConfigError as exc:
        raise ConfigError("compare", item, f"each entry must be one of {', '.join(allowed)} or a cache spec, "
                                           f"optionally @DIR or @base ({exc})") from exc
    where = where.strip()
    if not at:
        return System(kvforge_name(spec, swiftkv), "kvforge", spec)
    if where == "base":
        return System(f"base[{spec}]", "kvforge", spec, swiftkv=False)
    return System(f"swiftkv {Path(where).name}[{spec}]", "kvforge", spec, checkpoint=where)
