"""The systems a benchmark compares: one configuration each, named so that its JSON key
and its row say what ran."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from kvforge.cache.registry import CacheSpec


@dataclass(frozen=True)
class System:
    """One configuration measured: kvforge with a cache spec, the transformers peer (eager,
    `hf`, or static cache and compiled, `hf-static`: bench decode and prefill), the
    llama.cpp peer (bench.llamacpp_peer), vLLM's server (bench.serve_vllm) or a server
    already running at a URL (`external`)."""

    name: str
    kind: Literal["kvforge", "hf", "hf-static", "llama.cpp", "vllm", "external"]
    cache: CacheSpec | None = None
    # kvforge systems: run the --swiftkv model when one is given (False: SwiftKV's base model).
    swiftkv: bool = True
    # kvforge systems: this system's own SwiftKV checkpoint (`--compare SPEC@DIR`), over --swiftkv
    checkpoint: str | None = None
    # kvforge systems: every layer computes its K/V but one cache layer is stored (merge_all_layers.py)
    merge_all_layers: bool = False
    # kvforge systems: the engine's prefix caching (None: as --prefix-caching says; benchmarks
    # repeat their prompts, so it is off unless asked for)
    prefix_caching: bool | None = None
    # kvforge systems: run every step eagerly on CUDA (None: as --enforce-eager says)
    enforce_eager: bool | None = None
    # llama.cpp systems: the weights it runs (llamacpp_option.WEIGHTS: f16, bf16, f32, as-shipped)
    weights: str | None = None


def kvforge_name(spec: CacheSpec, swiftkv: str | None) -> str:
    """The name of a kvforge system with cache `spec`: on the --swiftkv model when one is given."""
    return f"swiftkv[{spec}]" if swiftkv else f"kvforge[{spec}]"


def unique_names(systems: list[System]) -> list[System]:
    """`--cache full --compare full` measures the same thing twice; keep JSON keys distinct."""
    seen: dict[str, int] = {}
    out = []
    for system in systems:
        seen[system.name] = seen.get(system.name, 0) + 1
        name = system.name if seen[system.name] == 1 else f"{system.name}#{seen[system.name]}"
        out.append(dataclasses.replace(system, name=name))
    return out
