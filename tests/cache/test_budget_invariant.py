"""The budget is a hard bound for every cache method: in engine runs under a budget tight
enough to force preemption, each tier's bytes in use stay within its capacity after every
step, and everything is returned at the end."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair

from kvforge.cache.registry import create_cache
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling import SamplingParams

SHADOWKV_SMALL = "shadowkv:chunk=4,local=8,outliers=2,min_context=24,generated_window=8,rank=4,budget=8"
# more per-sequence fixed state (outliers, exact buffers, reuse slots) than pages: its
# admission must count that state too
SHADOWKV_STATEFUL = "shadowkv:chunk=4,local=8,outliers=8,min_context=24,generated_window=32,rank=16,budget=32"
# KIVI with four residual slots: more than two sequences' pages hold, so the pages run out
# (and preemption happens) rather than the slots.
METHODS = ["full:block_size=4", "full:block_size=4,storage_dtype=bfloat16",
           "kivi:bits=2,group=4,residual=8,max_sequences=4", "kivi:bits=4,group=4,residual=8,max_sequences=4",
           SHADOWKV_SMALL, SHADOWKV_STATEFUL]


def _run(spec: str, arch: str, budget: int, admission: str = "optimistic") -> LLMEngine:
    _, model = make_pair(arch)
    cache = create_cache(spec, model.cache_layout(), budget, torch.float32)
    engine = LLMEngine(model, cache, None, EngineConfig(budget, max_num_batched_tokens=24, admission=admission))
    generator = torch.Generator().manual_seed(3)
    for length in (30, 41, 27, 35, 50, 33):
        prompt = torch.randint(3, 90, (length,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams.greedy_params(max_tokens=30, ignore_eos=True))
    capacity = cache.memory.capacity
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
        steps += 1
        for tier, used in cache.memory_usage().items():
            assert used <= capacity[tier], f"step {steps}: {tier} tier {used} bytes > budget {capacity[tier]}"
    if engine.prefix is not None:  # finished sequences stay, for a continuation, until evicted
        assert engine.prefix.kept_sequences <= 6
        engine.clear_prefix_cache()
    assert all(used == 0 for used in cache.memory_usage().values())
    return engine


def _tight_budget(spec: str, arch: str) -> int:
    """About two sequences of the longest kind (prompt 50 + 30 generated): room for some, not all."""
    _, model = make_pair(arch)
    probe = create_cache(spec, model.cache_layout(), 1 << 24, torch.float32)
    return int(2 * probe.memory.sequence_bytes(80))


@pytest.mark.parametrize("spec", METHODS)
@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3_hybrid"])
def test_usage_never_exceeds_the_budget_while_preempting(spec, arch):
    engine = _run(spec, arch, _tight_budget(spec, arch))
    assert engine.scheduler.num_preemptions > 0  # the budget really was tight


@pytest.mark.parametrize("spec", METHODS)
def test_reserving_admission_never_preempts_and_stays_within_the_budget(spec):
    engine = _run(spec, "llama_gqa", _tight_budget(spec, "llama_gqa"), admission="reserve")
    assert engine.scheduler.num_preemptions == 0
