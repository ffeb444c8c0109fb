"""The ranks ShadowKV settings choose when they compress one passage: the passage is
prefilled through the cache itself (chunks of `chunk_tokens`, logits on the last token,
which is what makes a prompt compress), and each setting's per-layer ranks are read from
the cache's statistics.

The front (shadowkv_front.py) derives an energy rule's ranks from the key spectra alone;
`rank=attention` also reads the prompt's last queries, so its ranks at a context can only
be measured this way. Energy rules measured here match the spectra's (a consistency check
the front applies when a setting is in both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from kvforge.cache.registry import create_cache
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.errors import require
from kvforge.models.causal_lm import CausalLM
from kvforge.tools.analysis.capture import passage_budget_bytes

CHUNK_TOKENS = 2048


def layer_ranks(statistics: dict[str, float]) -> list[int]:
    """Ranks of the global layers in order (`rank_layer_<i>` is the i-th global layer) from
    a ShadowKV cache's statistics after one compression."""
    prefix = "rank_layer_"
    by_index = {int(k[len(prefix):]): round(v) for k, v in statistics.items() if k.startswith(prefix)}
    return [by_index[i] for i in range(len(by_index))]


def measure_ranks(model: CausalLM, token_ids: Sequence[int], specs: Sequence[str],
                  chunk_tokens: int = CHUNK_TOKENS) -> list[dict[str, Any]]:
    """Per spec: {"cache": spec, "global_layers": cache layers, "ranks": their ranks} for one compression of
    `token_ids` (one sequence, positions 0..n-1)."""
    require(all(s.startswith("shadowkv") for s in specs), "specs", list(specs), "must all be shadowkv settings")
    out = []
    for spec in tqdm(specs, desc="settings", unit="setting"):
        # The whole passage stays exact until it compresses: the same room analysis gives it.
        parameter = next(model.parameters())
        cache = create_cache(spec, model.cache_layout(), passage_budget_bytes(model, len(token_ids)),
                             parameter.dtype, parameter.device)
        runner = ModelRunner(model, cache)
        with torch.no_grad():
            for start in range(0, len(token_ids), chunk_tokens):
                last = start + chunk_tokens >= len(token_ids)
                runner.step([StepItem(0, list(token_ids[start:start + chunk_tokens]), num_logits=int(last))])
        stats = cache.statistics()
        require(stats.get("compressions") == 1, "tokens", len(token_ids),
                f"must reach the setting's min_context to compress once ({spec})")
        out.append({"cache": spec, "global_layers": list(cache.global_layers), "ranks": layer_ranks(stats)})
    return out
