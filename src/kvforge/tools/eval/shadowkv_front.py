"""ShadowKV's quality/memory front (benchmarks/shadowkv_front.py is its command): for each
ShadowKV setting of `kvforge eval ppl` runs, its decode perplexity (and, where `kvforge eval
ruler` runs scored it, its RULER average against the full cache's on the same seeds) against
the fast-tier bytes its compressed layers hold at a long context.

An energy rule's ranks at N tokens come from the pre-RoPE key energy curves of an N-token
passage (`kvforge analyze key-spectra`) through the rule's own code (`ShadowKVConfig.layer_rank`,
what compression runs); `rank=attention` also reads the prompt's queries, so its ranks are
measured by compressing the same passage (shadowkv_ranks.py, `--ranks`); bytes from the cache's accounting (`compressed_global_bytes`, held
equal by a test to the bytes a compressed sequence keeps), global layers only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.cache.shadowkv.memory import paged_sequence_bytes
from kvforge.errors import require
from kvforge.models.loader import load_model_config, resolve_model_source
from kvforge.models.registry import model_class


def spectra_of_front(doc: dict[str, Any]) -> dict[str, Any]:
    """The global layers' energy curves a front file keeps, in `kvforge analyze key-spectra`'s
    shape, so a front can be rebuilt from an earlier one (e.g. with more runs)."""
    return {"num_tokens": doc["spectra_tokens"],
            "layers": [{"layer": int(c), "keys_pre_rope": {"energy": curve}} for c, curve in doc["energy"].items()]}


@functools.cache
def resolved_setting(spec: str) -> tuple[str, Any]:
    """A cache spec as (method, validated config, hashable): two spellings of one setting
    compare equal; `resolved_setting("full")` is the baseline the RULER deltas use."""
    parsed = parse_cache_spec(spec)
    return parsed.method, parsed.config()


def _ruler_by_seed(model: str, ruler: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[int, dict]]:
    """RULER runs (`kvforge eval ruler` files of `model` itself, no SwiftKV, one seed each)
    as ({lengths, tasks, ...}, {seed: {resolved setting: average}}). Every file must share
    the first one's settings and dtype, and no setting may be scored twice for one seed (an
    older run of a spec whose defaults have changed would otherwise pass for today's)."""
    keys = ("lengths", "tasks", "samples_per_task", "chat", "haystack_file")
    settings = {k: ruler[0]["settings"].get(k) for k in keys} | {"dtype": ruler[0].get("dtype")}
    scores: dict[int, dict] = {}
    for run in ruler:
        where = (run.get("provenance") or {}).get("command", "a RULER file without provenance")
        require(run["model"] == model, "ruler", run["model"], f"every RULER run must be of the front's model, {model}")
        mine = {k: run["settings"].get(k) for k in keys} | {"dtype": run.get("dtype")}
        require(mine == settings, "ruler", mine, f"every RULER run must have the first one's settings ({settings})")
        seed = run["settings"]["seed"]
        for system in run["systems"]:
            if system["kind"] != "kvforge":  # transformers peers
                continue
            require(system["name"].startswith("kvforge["), "ruler", system["name"],
                    "must be a run of the model itself (a --swiftkv run scores another model)")
            setting = resolved_setting(system["cache"])
            require(setting not in scores.get(seed, {}), "ruler", system["cache"],
                    f"is scored twice for seed {seed} (again in: {where}); pass one run per seed and setting")
            scores.setdefault(seed, {})[setting] = system["average"]
    return settings, scores


def _ruler_of(spec: str, scores: dict[int, dict]) -> dict[str, Any] | None:
    """Mean RULER average over the seeds that scored both this setting and the full cache
    (seeds without a full-cache run are skipped)."""
    setting, full = resolved_setting(spec), resolved_setting("full")
    pairs = [(seed, by_setting[setting], by_setting[full]) for seed, by_setting in sorted(scores.items())
             if setting in by_setting and full in by_setting]
    if not pairs:
        return None
    mine = sum(p[1] for p in pairs) / len(pairs)
    baseline = sum(p[2] for p in pairs) / len(pairs)
    return {"seeds": [p[0] for p in pairs], "average": mine, "full_average": baseline,
            "delta_points": mine - baseline}


def _measured_ranks(model: str, doc: dict[str, Any], passage_tokens: int) -> dict[Any, list[int]]:
    """{resolved setting: ranks} of a shadowkv_ranks.py file over the spectra's passage."""
    require(doc.get("eval") == "shadowkv-ranks" and doc["model"] == model, "ranks", doc.get("model"),
            f"must be a shadowkv_ranks.py file of {model}")
    require(doc["num_tokens"] == passage_tokens, "ranks", doc["num_tokens"],
            f"must be measured on the spectra's passage ({passage_tokens} tokens)")
    return {resolved_setting(s["cache"]): s["ranks"] for s in doc["systems"]}


def _ranks_of(spec: str, cache: Any, curves: dict[int, torch.Tensor], measured: dict[Any, list[int]]) -> list[int]:
    if cache.config.rank != "attention":
        return [cache.config.layer_rank(curves[c]) for c in cache.global_layers]
    setting = resolved_setting(spec)
    require(setting in measured, "ranks", spec, "rank=attention reads the prompt's queries: pass its ranks "
            "measured on the spectra's passage (benchmarks/shadowkv_ranks.py, --ranks)")
    return list(measured[setting])


def front(model: str, spectra: dict[str, Any], full: dict[str, Any], runs: list[dict[str, Any]],
          bytes_at_tokens: int | None = None, ruler: list[dict[str, Any]] | None = None,
          rank_file: dict[str, Any] | None = None) -> dict[str, Any]:
    """Bytes at `bytes_at_tokens` (default: the spectra's passage length; a longer one
    assumes the ranks of the passage, e.g. beyond a model's native context). `ruler`:
    `kvforge eval ruler` files of the same model (one seed each); a setting's RULER score is
    its mean over the seeds that scored both it and the default full cache, with the full
    cache's mean over the same seeds beside it. Settings are matched by their resolved
    configuration, so `shadowkv` and `shadowkv:energy=0.999` (the default) are one.
    `rank_file`: a shadowkv_ranks.py file of the spectra's passage, required for rank=attention settings."""
    config = load_model_config(resolve_model_source(model))
    layout = model_class(config).layout_for(config)
    num_tokens = int(bytes_at_tokens or spectra["num_tokens"])
    full_system = full["systems"][0]
    probe = create_cache("shadowkv", layout, 1 << 30, torch.float32, "cpu")
    # Cache layer c is model layer c here (no SwiftKV): the global layers' curves.
    curves = {c: torch.tensor(next(e for e in spectra["layers"] if e["layer"] == c)["keys_pre_rope"]["energy"],
                              dtype=torch.float64) for c in probe.global_layers}
    sizes = probe.memory.sizes
    full_bytes = paged_sequence_bytes(sizes.exact_layout, probe.config.block_size, sizes.element, num_tokens)
    ruler_settings, ruler_scores = _ruler_by_seed(model, ruler) if ruler else (None, {})
    measured = _measured_ranks(model, rank_file, int(spectra["num_tokens"])) if rank_file else {}
    systems = []
    for run in runs:
        require(run["settings"] == full["settings"] and run["text_file"] == full["text_file"], "runs",
                run["settings"], f"must score the full cache's windows ({full['settings']}, {full['text_file']})")
        for system in run["systems"]:
            spec = system["cache"]
            if not spec.startswith("shadowkv"):  # e.g. the full cache scored in the same run
                continue
            cache = create_cache(spec, layout, 1 << 30, torch.float32, "cpu")
            ranks = _ranks_of(spec, cache, curves, measured)
            fast = cache.memory.compressed_global_bytes(num_tokens, ranks)
            systems.append({"name": system["name"], "cache": spec, "ppl": system["ppl"],
                            "delta_pct": 100 * (system["ppl"] / full_system["ppl"] - 1), "ranks": ranks,
                            "fast_bytes": fast, "times_smaller": full_bytes / fast,
                            "ruler": _ruler_of(spec, ruler_scores)})
    return {"eval": "shadowkv-front", "model": model, "bytes_at_tokens": num_tokens,
            "spectra_tokens": int(spectra["num_tokens"]),
            "ppl_settings": full["settings"], "text_file": full["text_file"],
            "full": {"name": full_system["name"], "ppl": full_system["ppl"], "global_bytes": full_bytes},
            "global_layers": probe.global_layers,
            "energy": {str(c): curve.tolist() for c, curve in curves.items()}, "systems": systems,
            "ruler_settings": ruler_settings,
            "measured_ranks": rank_file.get("systems") if rank_file else None,
            "sources": {"full": full.get("provenance"), "runs": [r.get("provenance") for r in runs],
                        "ranks": rank_file.get("provenance") if rank_file else None,
                        "ruler": [r.get("provenance") for r in ruler or []]}}
