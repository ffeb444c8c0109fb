"""Executes one forward step for several sequences: prefill chunks and decode tokens mixed.

The runner turns per-sequence work items into a `ForwardBatch` and calls the model. It
does not decide *what* runs in a step, nor make room for it: in the engine the scheduler
allocates each sequence's storage once per step and the engine calls `execute`; drivers
without a scheduler call `step`, which allocates first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvforge.batch import ForwardBatch
from kvforge.cache.base import CacheMethod
from kvforge.engine.decode_graphs import DecodeGraphs
from kvforge.errors import CacheCapacityError, ConfigError
from kvforge.models.causal_lm import CausalLM
from kvforge.models.layers import pack_projections
from kvforge.models.packed_projections import packs_projections
from kvforge.step_plan import upload
from kvforge.step_timing import TimedCache, current_timer


@dataclass(frozen=True)
class StepItem:
    """New tokens of one sequence for this step. Logits are returned for the last
    `num_logits` of them: 1 for a prompt's final chunk or a decode token, 0 for a chunk
    in the middle of a prompt, len(token_ids) to score every token (perplexity, verify)."""

    seq_id: int
    token_ids: Sequence[int]
    num_logits: int = 1
    decode: bool = False  # generated tokens fed back (SwiftKV early exit applies to these only)


class ModelRunner:
    def __init__(self, model: CausalLM, cache: CacheMethod) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        if packs_projections(self.device):  # q/k/v and gate/up as one GEMM each (CUDA), before any capture
            pack_projections(model)
        self.max_positions = model.config.max_position_embeddings
        # Decode-only steps from fixed buffers and CUDA graphs (decode_graphs.py); None: eager.
        self.decode_graphs: DecodeGraphs | None = None

    def step(self, items: Sequence[StepItem]) -> torch.Tensor:
        """Make room for the step in the cache, as a scheduler would, then run it (drivers
        without a scheduler: evaluation, verification, tests). Returns logits [sum of
        num_logits, vocab], items in order."""
        cached = self._cached_lens(items)
        for item, have in zip(items, cached):
            total = have + len(item.token_ids)
            if not self.cache.allocate(item.seq_id, total):
                raise CacheCapacityError(
                    f"KV cache budget exhausted: sequence {item.seq_id} needs room for {total} tokens")
        return self._run(items, cached)

    def execute(self, items: Sequence[StepItem]) -> torch.Tensor:
        """Run a step whose storage the scheduler has allocated (the engine's path: one
        `allocate` per sequence and step, by the scheduler)."""
        return self._run(items, self._cached_lens(items))

    def _cached_lens(self, items: Sequence[StepItem]) -> list[int]:
        if not items:
            raise ConfigError("items", [], "a step needs at least one sequence")
        cached = [self.cache.num_cached_tokens(item.seq_id) for item in items]
        for item, have in zip(items, cached):
            total = have + len(item.token_ids)
            if total > self.max_positions:
                raise ConfigError("sequence length", total,
                                  f"must be <= max_position_embeddings={self.max_positions}")
        return cached

    def _run(self, items: Sequence[StepItem], cached: list[int]) -> torch.Tensor:
        timer = current_timer()
        graphs = self.decode_graphs if timer is None else None
        # Built on the host; a step the graphs decline (or run without them) sends it to the
        # device in one copy (step_plan.upload: nothing to copy on the CPU).
        batch = ForwardBatch.build(
            [item.seq_id for item in items], [item.token_ids for item in items], cached,
            [item.num_logits for item in items], device="cpu", decode=[item.decode for item in items])
        if graphs is not None:
            logits = graphs.run(batch)
            if logits is not None:
                return logits
        cache = self.cache if timer is None else TimedCache(self.cache, timer)
        with torch.inference_mode():
            return self.model(upload(batch, self.device), cache)

    def release(self, seq_id: int) -> None:
        self.cache.free(seq_id)
