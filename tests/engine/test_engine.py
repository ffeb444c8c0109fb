"""The engine on tiny random models: batch invariance, memory pressure, stop rules,
seeds, cancellation, and bad requests failing alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import make_pair

from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError


class LetterTokenizer:
    """id -> one letter; enough for detokenisation and stop strings."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def make_engine(arch="llama_gqa", budget=1 << 22, batched_tokens=64, tokenizer=None, max_model_len=None):
    _, model = make_pair(arch)
    cache = create_cache("full:block_size=4", model.cache_layout(), budget, torch.float32)
    config = EngineConfig(budget, max_num_batched_tokens=batched_tokens, max_model_len=max_model_len)
    return LLMEngine(model, cache, tokenizer, config)


def test_a_cache_sized_for_shorter_sequences_than_the_engine_allows_is_refused():
    """The cache's layout bounds its sequences (max_sequence_tokens; ShadowKV sizes a store
    by it): an engine allowing longer ones is a configuration error, named at start-up; one
    allowing at most that many tokens runs."""
    _, model = make_pair("llama_gqa")
    layout = replace(model.cache_layout(), max_sequence_tokens=50)
    for max_model_len, refused in ((None, True), (51, True), (50, False), (20, False)):
        cache = create_cache("full:block_size=4", layout, 1 << 20, torch.float32)
        config = EngineConfig(1 << 20, max_num_batched_tokens=16, max_model_len=max_model_len)
        if refused:
            with pytest.raises(ConfigError, match="max_model_len.*max_sequence_tokens=50"):
                LLMEngine(model, cache, None, config)
        else:
            assert LLMEngine(model, cache, None, config).max_model_len == max_model_len


def run_all(engine, requests):
    """requests: list of (prompt, params); returns outputs by position, plus peak memory."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        used = engine.cache.memory_usage()["fast"]
        assert used <= engine.cache.memory.capacity["fast"]
        peak = max(peak, used)
    return [finished[i] for i in ids], peak


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3_hybrid"])
def test_batch_invariance_with_chunked_mixed_steps(arch):
    lengths = [3, 10, 25, 40, 60, 7, 33, 90]
    max_tokens = [5, 12, 3, 9, 14, 6, 10, 4]
    requests = [(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
                for p, m in zip(prompts_of(lengths), max_tokens)]
    engine = make_engine(arch, batched_tokens=16)
    together, _ = run_all(engine, requests)
    assert engine.scheduler.peak_running > 1
    for request, out in zip(requests, together):
        alone, _ = run_all(make_engine(arch), [request])
        assert out.token_ids == alone[0].token_ids
        assert len(out.token_ids) == request[1].max_tokens and out.finish_reason == "length"


def test_memory_pressure_two_of_six_fit():
    _, model = make_pair("llama_gqa")
    per_sequence = create_cache("full:block_size=4", model.cache_layout(), 1 << 22,
                                torch.float32).memory.sequence_bytes(40 + 24)
    requests = [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
                for p in prompts_of([40] * 6, seed=4)]
    engine = make_engine(budget=2 * per_sequence, batched_tokens=64)
    tight, peak = run_all(engine, requests)
    roomy, _ = run_all(make_engine(), requests)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert peak <= 2 * per_sequence
    assert engine.scheduler.num_preemptions > 0  # admission is optimistic: growth preempts
    assert engine.cache.memory_usage()["fast"] == 0


def test_bad_requests_fail_alone():
    engine = make_engine(max_model_len=64)
    good = [(p, SamplingParams(temperature=0, max_tokens=8)) for p in prompts_of([5, 9])]
    reference, _ = run_all(make_engine(max_model_len=64), good)
    ids = [engine.add_request(p, s) for p, s in good]
    engine.step()
    with pytest.raises(ConfigError, match="prompt.*at least one token"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ConfigError, match="prompt length.*max_model_len"):
        engine.add_request([1] * 64, SamplingParams())
    with pytest.raises(ConfigError, match="prompt token id"):
        engine.add_request([1, 500], SamplingParams())
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ConfigError, match="cache"):
        parse_cache_spec("no-such-method")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert [finished[i].token_ids for i in ids] == [o.token_ids for o in reference]


def test_a_sequence_outgrowing_the_whole_budget_alone_ends_with_an_error_naming_kv_budget():
    """Admission checks prompt + 1 tokens (a request may stop early, as in vLLM); one that
    then grows past what the whole cache holds ends with an error that says which setting."""
    engine = make_engine(budget=4 * 2 * 3 * 2 * 16 * 4 * 4)  # 4 pages of 4 tokens
    request = engine.add_request(list(range(1, 11)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    error = finished[request].error
    assert error is not None and "kv_budget" in error and "cannot hold this sequence even alone at 17 tokens" in error


def test_prompt_larger_than_budget_is_rejected():
    engine = make_engine(budget=4 * 2 * 3 * 2 * 16 * 4 * 4)  # 4 pages of 4 tokens
    with pytest.raises(ConfigError, match="kv_budget"):
        engine.add_request(list(range(30)), SamplingParams())


def test_seeded_sampling_is_batch_independent():
    prompts = prompts_of([12, 30, 7])
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)
    others = [SamplingParams(temperature=1.0, seed=5, max_tokens=6), SamplingParams(temperature=0, max_tokens=9)]
    together, _ = run_all(make_engine(batched_tokens=16), list(zip(prompts, [sampled, *others])))
    alone, _ = run_all(make_engine(), [(prompts[0], sampled)])
    assert together[0].token_ids == alone[0].token_ids
    again, _ = run_all(make_engine(), [(prompts[0], sampled)])
    assert again[0].token_ids == alone[0].token_ids


def test_stop_rules():
    engine = make_engine(tokenizer=LetterTokenizer())
    prompt = prompts_of([10])[0]
    free, _ = run_all(engine, [(prompt, SamplingParams(temperature=0, max_tokens=12))])
    tokens = free[0].token_ids
    # stop token id: the fourth generated token ends the request and is kept in token_ids
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    out, _ = run_all(engine, [(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))])
    assert out[0].token_ids == tokens[:first + 1] and out[0].finish_reason == "stop"
    # min_tokens bans the stop id until enough tokens exist
    out, _ = run_all(engine, [(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2,
                                                      stop_token_ids=[stop_id]))])
    assert stop_id not in out[0].token_ids[:first + 2]
    # stop string: text is cut where it starts
    text = free[0].text
    stop_string = text[5:7]
    out, _ = run_all(engine, [(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop_string]))])
    assert out[0].text == text[:text.index(stop_string)] and out[0].finish_reason == "stop"
    # the context limit ends generation with reason "length"
    short = make_engine(max_model_len=14)
    out, _ = run_all(short, [(prompt, SamplingParams(temperature=0, max_tokens=12))])
    assert len(out[0].token_ids) == 4 and out[0].finish_reason == "length"


def test_logprobs_and_metrics():
    engine = make_engine()
    out, _ = run_all(engine, [(prompts_of([6])[0], SamplingParams(temperature=0, max_tokens=5, logprobs=True))])
    result = out[0]
    assert len(result.logprobs) == 5 and all(lp <= 0 for lp in result.logprobs)
    m = result.metrics
    assert m.prompt_tokens == 6 and m.output_tokens == 5
    assert 0 <= m.time_to_first_token <= m.latency and m.time_per_output_token >= 0


def test_abort_frees_cache_and_others_continue():
    engine = make_engine()
    keep, drop = prompts_of([8, 8])
    keep_id = engine.add_request(keep, SamplingParams(temperature=0, max_tokens=10))
    drop_id = engine.add_request(drop, SamplingParams(temperature=0, max_tokens=10))
    engine.step()
    aborted = engine.abort_request(drop_id)
    assert aborted[0].finish_reason == "abort" and engine.cache.num_cached_tokens(1) == 0
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert len(done[keep_id].token_ids) == 10


def test_uncomputed_prompt_tokens_count_down_with_chunked_prefill():
    """The prefill progress the decode benchmark shows: prompt tokens not yet in the cache."""
    engine = make_engine(batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for prompt in prompts_of([20, 30]):
        engine.add_request(prompt, params)
    seen = [engine.num_uncomputed_prompt_tokens()]
    while engine.has_unfinished_requests():
        engine.step()
        seen.append(engine.num_uncomputed_prompt_tokens())
    # Steps 1-2 spend their 16-token budget on prompts; from step 3 the first request's
    # decode token takes one of the 16, then only decode steps remain.
    assert seen[:5] == [50, 34, 18, 3, 0]
    assert all(later == 0 for later in seen[4:])


def test_ignore_eos_generates_past_the_eos_token():
    import dataclasses

    engine = make_engine()
    prompt = prompts_of([9])[0]
    (free_run,), _ = run_all(engine, [(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])
    eos = free_run.token_ids[2]
    engine.model.config = dataclasses.replace(engine.model.config, eos_token_ids=(eos,))
    stopped_engine = LLMEngine(engine.model, engine.cache, None, engine.config)
    (stopped,), _ = run_all(stopped_engine, [(prompt, SamplingParams(temperature=0, max_tokens=8))])
    assert stopped.token_ids == free_run.token_ids[:free_run.token_ids.index(eos) + 1]
    assert stopped.finish_reason == "stop"
    (ignored,), _ = run_all(stopped_engine, [(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])
    assert ignored.token_ids == free_run.token_ids and ignored.finish_reason == "length"
