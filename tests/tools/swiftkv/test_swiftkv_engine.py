"""A SwiftKV model under the engine's scheduler: chunked prefill, mixed steps, greedy
outputs equal to the dense reference, and AcrossKV's smaller cache admitting more."""

from __future__ import annotations

import torch
from swiftkv_helpers import across_kv_pair

from kvforge.cache.registry import create_cache
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling import SamplingParams
from kvforge.models.dense import dense_logits


def engine_for(model, budget: int = 1 << 22, batched_tokens: int = 16) -> LLMEngine:
    cache = create_cache("full:block_size=4", model.cache_layout(), budget, torch.float32)
    return LLMEngine(model, cache, None, EngineConfig(budget, max_num_batched_tokens=batched_tokens))


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def dense_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            tokens.append(int(dense_logits(model, torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def prompts_of(lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 96, (n,), generator=generator).tolist() for n in lengths]


def test_engine_greedy_equals_dense_reference():
    _, model = across_kv_pair()
    prompts = prompts_of([3, 10, 25, 40, 7, 33])
    engine = engine_for(model)
    outputs = run(engine, prompts, max_tokens=6)
    assert engine.scheduler.peak_running > 1
    for prompt, output in zip(prompts, outputs):
        assert output == dense_greedy(model, prompt, 6)


def test_across_kv_admits_more_sequences_under_one_budget():
    base, swift = across_kv_pair()  # 5 cache layers vs 3
    prompts = prompts_of([24] * 8)
    peaks = {}
    for name, model in (("base", base), ("swiftkv", swift)):
        page = 4 * 2 * 2 * 16 * 4  # block 4 x (K, V) x kv_heads 2 x head_dim 16 x fp32
        budget = page * 5 * 8 * 3  # pages for 3 sequences of 32 tokens in 5 cache layers
        engine = engine_for(model, budget=budget, batched_tokens=256)
        run(engine, prompts, max_tokens=8)
        peaks[name] = engine.scheduler.peak_running
    # Admission checks the prompt's 6 pages per cache layer: 120 page-layers hold
    # 4 prompts of 5 layers (30 each) but 6 prompts of 3 layers (18 each).
    assert peaks == {"base": 4, "swiftkv": 6}
