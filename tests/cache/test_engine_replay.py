"""A whole engine whose decode steps replay captured graphs generates what the eager engine
generates: requests of different lengths arriving while others decode (chunked prefill
beside decode steps, which stay eager), prompts sharing a prefix (prefix-cache hits),
greedy and seeded sampling, an abort, and preemption under a tight budget. The graphs are
captured at start-up as LLMEngine does on CUDA; here graph_replay.py emulates capture and
replay on the CPU (static_steps.Replayed)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair
from static_steps import Replayed

from kvforge.cache.registry import create_cache
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling import SamplingParams
from kvforge.host_sync import device_code_paths

KIVI = "kivi:bits=2,group=4,residual=8"


def _engine(model, spec: str, budget: int, replay: bool) -> tuple[LLMEngine, Replayed | None]:
    cache = create_cache(spec, model.cache_layout(), budget, torch.float32)
    engine = LLMEngine(model, cache, None, EngineConfig(kv_budget_bytes=budget, max_num_batched_tokens=24,
                                                        max_num_seqs=8))
    graphs = None
    if replay:
        graphs = engine.runner.decode_graphs = Replayed(model, cache, 8, 64, capture=True)
        assert graphs.capture().graphs == len(graphs.steps) > 0
    return engine, graphs


def _serve(engine: LLMEngine) -> dict[str, list[int]]:
    """Four requests, then three more arriving mid-way (two sharing a prompt prefix with the
    first ones), one of them aborted; returns every finished request's tokens."""
    shared = list(range(3, 23))
    first = [shared + [40, 41], list(range(50, 57)), shared + [60], list(range(5, 38, 2))]
    later = [shared + [70, 71, 72], list(range(80, 89)), list(range(11, 30))]
    greedy = SamplingParams.greedy_params(max_tokens=18, ignore_eos=True)
    seeded = SamplingParams(max_tokens=14, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    done: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            assert out.error is None
            if out.finished:
                done[out.request_id] = out.token_ids

    for n, prompt in enumerate(first):
        engine.add_request(prompt, seeded if n == 1 else greedy, request_id=f"a{n}")
    for _ in range(6):
        step()
    for n, prompt in enumerate(later):
        engine.add_request(prompt, seeded if n == 2 else greedy, request_id=f"b{n}")
    step()
    engine.abort_request("a3")
    while engine.has_unfinished_requests():
        step()
    return done


@pytest.mark.parametrize("spec, budget", [("full:block_size=4", 1 << 22), (KIVI, 1 << 22),
                                          ("full:block_size=4", 100_000)], ids=["full", "kivi", "full-preempted"])
def test_an_engine_replaying_its_decode_steps_generates_the_eager_tokens(spec, budget):
    model = make_pair("llama_gqa")[1]
    with device_code_paths():  # the branches CUDA takes, in both engines
        eager_engine, _ = _engine(model, spec, budget, replay=False)
        expected = _serve(eager_engine)
        engine, graphs = _engine(model, spec, budget, replay=True)
        got = _serve(engine)
    assert got == expected and len(got) == 6 and "a3" not in got
    assert graphs is not None and graphs.static_steps >= 15
    assert engine.scheduler.num_preemptions == eager_engine.scheduler.num_preemptions
    assert (engine.scheduler.num_preemptions > 0) == (budget < 1 << 20)
