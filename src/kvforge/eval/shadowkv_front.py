"""ShadowKV's quality/memory front (benchmarks/shadowkv_front.py is its command): for each
ShadowKV setting of `kvforge eval ppl` runs, its decode perplexity (and, where `kvforge eval
ruler` runs scored it, its RULER average against the full cache's on the same seeds) against
the fast-tier bytes its compressed layers hold at a long context.

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


def spectra_of_front(doc: dict[str, Any]) -> dict[str, Any]:
    """The global layers' energy curves a front file keeps, in `kvforge analyze key-spectra`'s
    shape, so a front can be rebuilt from an earlier one (e.g. with more runs)."""
    return {"num_tokens": doc["spectra_tokens"],
            "layers": [{"layer": int(c), "keys_pre_rope": {"energy": curve}} for c, curve in doc["energy"].items()]}


def _ruler_by_seed(model: str, ruler: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[int, dict[str, float]]]:
    """RULER runs (`kvforge eval ruler` files of `model`, one seed each) grouped as
    {seed: {cache spec: average}}; every file must run the same lengths, tasks and samples."""
    keys = ("lengths", "tasks", "samples_per_task", "chat", "haystack_file")
    settings = {k: ruler[0]["settings"].get(k) for k in keys}
    scores: dict[int, dict[str, float]] = {}
    for run in ruler:
        require(run["model"] == model, "ruler", run["model"], f"every RULER run must be of the front's model, {model}")
        mine = {k: run["settings"].get(k) for k in keys}
        require(mine == settings, "ruler", mine, f"every RULER run must have the first one's settings ({settings})")
        for system in run["systems"]:
            if system["kind"] == "kvforge":
                scores.setdefault(run["settings"]["seed"], {})[system["cache"]] = system["average"]
    return settings, scores


def _ruler_of(spec: str, scores: dict[int, dict[str, float]], same_cache) -> dict[str, Any] | None:
    """Mean RULER average over the seeds that scored both this setting and the full cache."""
    pairs = [(seed, next((v for s, v in by_spec.items() if same_cache(s, spec)), None), by_spec.get("full"))
             for seed, by_spec in sorted(scores.items())]
    pairs = [(seed, mine, full) for seed, mine, full in pairs if mine is not None and full is not None]
    if not pairs:
        return None
    mine = sum(p[1] for p in pairs) / len(pairs)
    full = sum(p[2] for p in pairs) / len(pairs)
    return {"seeds": [p[0] for p in pairs], "average": mine, "full_average": full, "delta_points": mine - full}


def front(model: str, spectra: dict[str, Any], full: dict[str, Any], runs: list[dict[str, Any]],
          bytes_at_tokens: int | None = None, ruler: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Bytes at `bytes_at_tokens` (default: the spectra's passage length; a longer one
    assumes the ranks of the passage, e.g. beyond a model's native context). `ruler`:
    `kvforge eval ruler` files of the same model (one seed each; the full cache scored for
    every seed used); a setting's RULER score is its mean over the seeds that scored it, with
    the full cache's mean over the same seeds beside it. Settings are matched by their
    resolved configuration, so `shadowkv` and `shadowkv:energy=0.999` (the default) are one."""
    config = load_model_config(resolve_model_source(model))
    layout = model_class(config).layout_for(config)
    num_tokens = int(bytes_at_tokens or spectra["num_tokens"])
    full_system = full["systems"][0]
    probe = create_cache("shadowkv", layout, 1 << 30, torch.float32, "cpu")
    # Cache layer c is model layer c here (no SwiftKV): the global layers' curves.
    curves = {c: torch.tensor(next(e for e in spectra["layers"] if e["layer"] == c)["keys_pre_rope"]["energy"],
                              dtype=torch.float64) for c in probe.global_layers}
    full_bytes = paged_sequence_bytes(probe.exact_layout, probe.config.block_size, probe.element, num_tokens)
    def config_of(spec: str):
        return create_cache(spec, layout, 1 << 30, torch.float32, "cpu").config

    def same_cache(a: str, b: str) -> bool:
        return a.startswith("shadowkv") and b.startswith("shadowkv") and config_of(a) == config_of(b)

    ruler_settings, ruler_scores = _ruler_by_seed(model, ruler) if ruler else (None, {})
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
                            "fast_bytes": fast, "times_smaller": full_bytes / fast,
                            "ruler": _ruler_of(spec, ruler_scores, same_cache)})
    return {"eval": "shadowkv-front", "model": model, "bytes_at_tokens": num_tokens,
            "spectra_tokens": int(spectra["num_tokens"]),
            "ppl_settings": full["settings"], "text_file": full["text_file"],
            "full": {"name": full_system["name"], "ppl": full_system["ppl"], "global_bytes": full_bytes},
            "global_layers": probe.global_layers,
            "energy": {str(c): curve.tolist() for c, curve in curves.items()}, "systems": systems,
            "ruler_settings": ruler_settings,
            "sources": {"full": full.get("provenance"), "runs": [r.get("provenance") for r in runs],
                        "ruler": [r.get("provenance") for r in ruler or []]}}
