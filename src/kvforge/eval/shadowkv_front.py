"""ShadowKV's quality/memory front (benchmarks/shadowkv_front.py is its command): for each
ShadowKV setting of `kvforge eval ppl` runs, its decode perplexity against the fast-tier
bytes its compressed layers hold at a long context.

A rule's ranks at N tokens come from the pre-RoPE key energy curves of an N-token passage
(`kvforge analyze key-spectra`) through the rule's own code (`ShadowKVConfig.layer_rank`,
what compression runs); bytes from the cache's accounting (`compressed_global_bytes`, held
equal by a test to the bytes a compressed sequence keeps), global layers only.
"""

from __future__ import annotations

from typing import Any

import torch

from kvforge.cache.registry import create_cache
from kvforge.cache.shadowkv.memory import paged_sequence_bytes
from kvforge.errors import require
from kvforge.models.loader import load_model_config, resolve_model_source
from kvforge.models.registry import model_class


def front(model: str, spectra: dict[str, Any], full: dict[str, Any], runs: list[dict[str, Any]],
          bytes_at_tokens: int | None = None) -> dict[str, Any]:
    """Bytes at `bytes_at_tokens` (default: the spectra's passage length; a longer one
    assumes the ranks of the passage, e.g. beyond a model's native context)."""
    config = load_model_config(resolve_model_source(model))
    layout = model_class(config).layout_for(config)
    num_tokens = int(bytes_at_tokens or spectra["num_tokens"])
    full_system = full["systems"][0]
    probe = create_cache("shadowkv", layout, 1 << 30, torch.float32, "cpu")
    # Cache layer c is model layer c here (no SwiftKV): the global layers' curves.
    curves = {c: torch.tensor(next(e for e in spectra["layers"] if e["layer"] == c)["keys_pre_rope"]["energy"],
                              dtype=torch.float64) for c in probe.global_layers}
    full_bytes = paged_sequence_bytes(probe.exact_layout, probe.config.block_size, probe.element, num_tokens)
    systems = []
    for run in runs:
        require(run["settings"] == full["settings"] and run["text_file"] == full["text_file"], "runs",
                run["settings"], f"must score the full cache's windows ({full['settings']}, {full['text_file']})")
        for system in run["systems"]:
            spec = system["cache"]
            if not spec.startswith("shadowkv"):  # e.g. the full cache scored in the same run
                continue
            cache = create_cache(spec, layout, 1 << 30, torch.float32, "cpu")
            ranks = [cache.config.layer_rank(curves[c]) for c in cache.global_layers]
            fast = cache.compressed_global_bytes(num_tokens, ranks)
            systems.append({"name": system["name"], "cache": spec, "ppl": system["ppl"],
                            "delta_pct": 100 * (system["ppl"] / full_system["ppl"] - 1), "ranks": ranks,
                            "fast_bytes": fast, "times_smaller": full_bytes / fast})
    return {"eval": "shadowkv-front", "model": model, "bytes_at_tokens": num_tokens,
            "spectra_tokens": int(spectra["num_tokens"]),
            "ppl_settings": full["settings"], "text_file": full["text_file"],
            "full": {"name": full_system["name"], "ppl": full_system["ppl"], "global_bytes": full_bytes},
            "global_layers": probe.global_layers,
            "energy": {str(c): curve.tolist() for c, curve in curves.items()}, "systems": systems,
            "sources": {"full": full.get("provenance"), "runs": [r.get("provenance") for r in runs]}}
