"""One workload through a `ModelRunner`: the prompts prefilled together in chunks, then
batched decode steps, with the logits of every scored row kept (on the CPU, float32).

The token fed at each decode step is either the runner's own greedy choice or a forced one
(the reference's), so the device can be compared with the reference position by position
on identical inputs, and separately on its own greedy path.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvforge.cache.registry import create_cache
from kvforge.engine.decode_graphs import DecodeGraphs
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.kernels.build import DISABLE_ENV
from kvforge.models.causal_lm import CausalLM
from kvforge.tools.gpu_check.rows import Workload


@dataclass
class Trace:
    """Per sequence: logits [prefill rows + gen - 1, vocab] (the scored prompt rows, then one
    row per decode step) and the `gen` generated tokens; `prefill_rows` per sequence."""

    logits: list[torch.Tensor]
    tokens: list[list[int]]
    prefill_rows: list[int]


@contextmanager
def pytorch_paths() -> Iterator[None]:
    """Every C++ CPU kernel off (they read the variable at each call), so the reference is
    the plain PyTorch path; the previous setting is restored afterwards."""
    previous = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = previous


def run_workload(model: CausalLM, cache_spec: str, kv_budget: int, prompts: Sequence[Sequence[int]],
                 work: Workload, forced: Sequence[Sequence[int]] | None = None, graphs: bool = False) -> Trace:
    """Run `prompts` on a fresh cache of `cache_spec` on the model's device; with `graphs` on
    a CUDA device, decode steps replay CUDA graphs captured for this workload's shape, as the
    engine's do (methods without a static form run eagerly)."""
    device = next(model.parameters()).device
    cache = create_cache(cache_spec, model.cache_layout(), kv_budget, torch.float32, device)
    runner = ModelRunner(model, cache)
    if graphs and device.type == "cuda":
        decode_graphs = DecodeGraphs(model, cache, len(prompts), max(len(p) for p in prompts) + work.gen,
                                     capture=True)
        decode_graphs.capture()
        runner.decode_graphs = decode_graphs if decode_graphs.enabled else None
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for start in range(0, max(len(p) for p in prompts), work.chunk):
        items = [StepItem(seq, list(p[start:start + work.chunk]), num_logits=min(work.scored, len(p) - start))
                 for seq, p in enumerate(prompts) if start < len(p)]
        _collect(runner.step(items), items, rows)
    prefill_rows = [sum(r.shape[0] for r in seq_rows) for seq_rows in rows]
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(work.gen):
        for seq in range(len(prompts)):
            tokens[seq].append(int(forced[seq][step]) if forced is not None else int(rows[seq][-1][-1].argmax()))
        if step == work.gen - 1:
            break
        items = [StepItem(seq, [tokens[seq][-1]]) for seq in range(len(prompts))]
        _collect(runner.step(items), items, rows)
    for seq in range(len(prompts)):
        runner.release(seq)
    return Trace([torch.cat(seq_rows) for seq_rows in rows], tokens, prefill_rows)


def _collect(logits: torch.Tensor, items: Sequence[StepItem], rows: list[list[torch.Tensor]]) -> None:
    logits = logits.detach().float().cpu()
    offset = 0
    for item in items:
        rows[item.seq_id].append(logits[offset:offset + item.num_logits])
        offset += item.num_logits
