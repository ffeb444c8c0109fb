"""Prefix caching: shared pages (full) and continued sequences (kivi, shadowkv) give the
outputs of the same work done from scratch, references and bytes always come back, the
budget holds while cached pages are evicted, and bad interactions (prompt logprobs, the
same prompt twice in a step, preemption, abort) stay correct."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import make_pair

from kvforge.cache.registry import create_cache
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.prefix_cache import page_keys
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "tools" / "swiftkv"))
from swiftkv_helpers import swiftkv_model  # noqa: E402

GREEDY = SamplingParams.greedy_params(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2)
NEAR_TIE = 1e-3  # a top-2 margin this small may flip with the batch's rounding (split-K, BLAS)


def _assert_same_greedy(got, reference) -> None:
    """Token for token, except that after a near tie in the reference the two may part."""
    for out, ref in zip(got, reference):
        for i, (token, expected) in enumerate(zip(out.token_ids, ref.token_ids)):
            if token != expected:
                (_, best), (_, second) = ref.top_logprobs[i][:2]
                assert best - second < NEAR_TIE, f"differ at {i} without a near tie: {out.token_ids} {ref.token_ids}"
                break


def _engine(model, spec="full:block_size=4", budget=1 << 22, batched=24, prefix=True) -> LLMEngine:
    cache = create_cache(spec, model.cache_layout(), budget, torch.float32)
    return LLMEngine(model, cache, None, EngineConfig(budget, max_num_batched_tokens=batched, prefix_caching=prefix))


def _run(engine, prompts, params=GREEDY, check_budget=True) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    capacity = engine.cache.memory.capacity
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
            if out.finished:
                done[out.request_id] = out
        if check_budget:
            assert all(engine.cache.memory_usage()[t] <= capacity[t] for t in capacity)
    return [done[i] for i in ids]


def _shared_prompts(count=5, shared=37, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 90, (shared,), generator=gen).tolist()
    return [system + torch.randint(3, 90, (3 + 4 * i,), generator=gen).tolist() for i in range(count)]


def test_page_keys_chain_over_the_whole_prefix():
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [])
    assert len(a) == 2  # only full pages
    b = page_keys([1, 2, 3, 4, 5, 6, 7, 9], 4, [])
    assert a[0] == b[0] and a[1] != b[1]
    c = page_keys([0, 2, 3, 4, 5, 6, 7, 8], 4, [])
    assert a[1] != c[1]  # the same page after a different prefix has another name
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, a) == page_keys(list(range(1, 13)), 4, [])


@pytest.mark.parametrize("arch, seed", [("llama_gqa", 0), ("gemma3_hybrid", 0), ("gemma3_hybrid", 3),
                                        ("gemma3_hybrid", 6), ("mistral_window", 0), ("mistral_window", 4)])
def test_shared_pages_give_the_outputs_of_computing_from_scratch(arch, seed):
    """Sliding-window layers included: a long chunk never stores the tokens already out of
    its window, so only pages wholly inside a window are shared."""
    _, model = make_pair(arch, seed=seed)
    prompts = _shared_prompts()
    reference = _run(_engine(model, prefix=False), prompts)
    engine = _engine(model)
    first = _run(engine, prompts[:1])  # publishes the system prompt's pages
    rest = _run(engine, prompts[1:])  # a mixed batch, chunked prefill, all hitting them
    _assert_same_greedy(first + rest, reference)
    stats = engine.prefix_statistics()
    if arch == "llama_gqa":
        assert stats["prefix_hits"] == 4 and stats["prefix_hit_tokens"] >= 4 * 36
    else:  # a window's pages are shareable only where a step ended near them
        assert stats["prefix_hits"] >= 1 and stats["prefix_hit_tokens"] >= 8
    assert engine.cache.memory_usage()["fast"] == 0  # every reference came back
    assert engine.cache.pages.pool.num_cached > 0  # the pages stay cached, unreferenced


def test_swiftkv_model_with_shared_pages():
    _, base = make_pair("llama_gqa")
    model = swiftkv_model(base, first_later=1, group=2)
    prompts = _shared_prompts(count=3)
    reference = _run(_engine(model, prefix=False), prompts)
    engine = _engine(model)
    _assert_same_greedy(_run(engine, prompts[:1]) + _run(engine, prompts[1:]), reference)
    assert engine.prefix_statistics()["prefix_hits"] == 2


def test_a_whole_cached_prompt_still_computes_its_last_token():
    _, model = make_pair("llama_gqa")
    prompt = list(range(3, 3 + 16))  # exactly 4 full pages
    engine = _engine(model)
    once = _run(engine, [prompt])[0].token_ids
    again = _run(engine, [prompt])[0].token_ids
    assert again == once
    assert engine.prefix_statistics()["prefix_hit_tokens"] == 12  # 3 pages: the 4th holds the last token


def test_same_prompt_twice_in_one_step_and_prompt_logprobs_skip_the_cache():
    _, model = make_pair("llama_gqa")
    prompt = _shared_prompts(count=1)[0]
    engine = _engine(model)
    a, b = _run(engine, [prompt, prompt])
    assert a.token_ids == b.token_ids
    logprob_params = SamplingParams.greedy_params(max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    (scored,) = _run(engine, [prompt], logprob_params)
    assert len(scored.prompt_logprobs) == len(prompt)  # every prompt row was computed
    assert engine.prefix_statistics()["prefix_queries"] == 2  # the logprob request did not look


def test_references_return_after_preemption_and_abort_and_eviction_keeps_the_budget():
    _, model = make_pair("llama_gqa")
    per_sequence = create_cache("full:block_size=4", model.cache_layout(), 1 << 22,
                                torch.float32).memory.sequence_bytes(60)
    prompts = _shared_prompts(count=6, shared=29, seed=3)
    params = SamplingParams.greedy_params(max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=2)
    reference = _run(_engine(model, prefix=False, budget=1 << 22), prompts, params)
    engine = _engine(model, budget=int(2.2 * per_sequence))
    outs = _run(engine, prompts, params)  # tight: preemption, and cached pages reclaimed
    _assert_same_greedy(outs, reference)
    pool = engine.cache.pages.pool
    assert engine.scheduler.num_preemptions > 0 and pool.evictions > 0
    assert pool.num_used == 0 and all(pool.refs(b) == 0 for b in range(pool.num_blocks))
    request_id = engine.add_request(prompts[0], params)
    engine.step()
    engine.step()
    engine.abort_request(request_id)
    assert pool.num_used == 0


def _converse(engine, turns: list[list[int]], params=GREEDY) -> list[list[int]]:
    """One conversation, a request per turn carrying the whole history; the replies."""
    history: list[int] = []
    replies = []
    for turn in turns:
        history += turn
        (out,) = _run(engine, [history], params)
        replies.append(out.token_ids)
        history += out.token_ids
    return replies


@pytest.mark.parametrize("spec", ["kivi:bits=2,group=4,residual=8", "kivi:bits=4,group=4,residual=8",
                                  "kivi:bits=2,group=4,residual=12"])
@pytest.mark.parametrize("swiftkv", [False, True])
def test_kivi_turns_start_from_snapshots_and_equal_no_prefix_caching(spec, swiftkv):
    """Each turn starts from a fork of the state at the start of an earlier prompt's last
    prefill chunk, where the run without prefix caching begins a chunk too: alone on the
    engine, every turn's tokens equal prefix caching off, lossy 2-bit KIVI included."""
    _, base = make_pair("llama_gqa")
    model = swiftkv_model(base, first_later=1, group=2) if swiftkv else base
    gen = torch.Generator().manual_seed(7)
    turns = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (30, 7, 12, 5)]
    params = SamplingParams.greedy_params(max_tokens=6, ignore_eos=True)
    on = _engine(model, spec, batched=16)
    assert _converse(on, turns, params) == _converse(_engine(model, spec, batched=16, prefix=False), turns, params)
    stats = on.prefix_statistics()
    # turn 1 (30 tokens) is chunked [0, 16) [16, 30): the snapshot at 16 serves turn 2, whose
    # history (43) is chunked from there [16, 32) [32, 43), leaving a snapshot at 32, ...
    assert stats["prefix_hits"] == 3 and stats["prefix_snapshots"] == 4
    assert stats["prefix_hit_tokens"] == 16 + 32 + 48
    on.clear_prefix_cache()
    assert on.cache.memory_usage()["fast"] == 0


def test_a_kivi_hit_in_a_mixed_batch_with_chunked_prefill_equals_no_prefix_caching():
    """Turn 2 (starting from the snapshot at 16) shares 16-token steps with a new request;
    first come, first served, the newcomer's chunks start where they start without the hit
    (after turn 2's last chunk), so both requests give the no-cache tokens."""
    _, model = make_pair("llama_gqa")
    spec = "kivi:bits=2,group=4,residual=8"
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 90, (30,), generator=gen).tolist()
    message, other = (torch.randint(3, 90, (n,), generator=gen).tolist() for n in (13, 20))
    params = SamplingParams.greedy_params(max_tokens=6, ignore_eos=True)
    outputs = []
    for prefix in (True, False):
        engine = _engine(model, spec, batched=16, prefix=prefix)
        (turn1,) = _run(engine, [prompt], params)
        outputs.append([o.token_ids for o in _run(engine, [prompt + turn1.token_ids + message, other], params)])
        if prefix:
            assert engine.prefix_statistics()["prefix_hit_tokens"] == 16
    assert outputs[0] == outputs[1]


def test_a_kivi_snapshot_is_a_fork_not_a_move():
    """Two requests extending the same snapshot both start from it (each from its own fork)
    and get what they get without prefix caching; the pages they share are freed once."""
    _, model = make_pair("llama_gqa")
    spec = "kivi:bits=2,group=4,residual=8"
    gen = torch.Generator().manual_seed(8)
    first = torch.randint(3, 90, (30,), generator=gen).tolist()
    later = [first + torch.randint(3, 90, (n,), generator=gen).tolist() for n in (9, 21)]
    params = SamplingParams.greedy_params(max_tokens=5, ignore_eos=True)
    on, off = _engine(model, spec, batched=16), _engine(model, spec, batched=16, prefix=False)
    for prompt in [first, *later]:
        assert _run(on, [prompt], params)[0].token_ids == _run(off, [prompt], params)[0].token_ids
    assert on.prefix_statistics()["prefix_hit_tokens"] == 2 * 16
    on.clear_prefix_cache()
    pool = on.cache.pages.pool
    assert pool.num_used == 0 and all(pool.refs(b) == 0 for b in range(pool.num_blocks))


@pytest.mark.parametrize("spec", ["shadowkv:chunk=4,local=8,outliers=2,min_context=24,generated_window=8,rank=4,"
                                  "budget=8"])
def test_a_conversation_continues_its_sequence_exactly(spec):
    """Turn 2 = turn 1's prompt + reply + a new message: it continues turn 1's sequence and
    gives what the same steps give on a runner (turn-1 prompt, its decode tokens one by
    one, then the new tokens as one chunk), with or without other requests around."""
    _, model = make_pair("llama_gqa")
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 90, (30,), generator=gen).tolist()
    message = torch.randint(3, 90, (7,), generator=gen).tolist()
    engine = _engine(model, spec, batched=64)
    (turn1,) = _run(engine, [prompt])
    turn2_prompt = prompt + turn1.token_ids + message
    other = torch.randint(3, 90, (20,), generator=gen).tolist()
    turn2, _ = _run(engine, [turn2_prompt, other])
    stats = engine.prefix_statistics()
    assert stats["prefix_continued_sequences"] == 1 and stats["prefix_hit_tokens"] == len(prompt) + 5

    runner = ModelRunner(model, create_cache(spec, model.cache_layout(), 1 << 22, torch.float32))
    logits = runner.step([StepItem(0, prompt)])
    assert int(logits[0].argmax()) == turn1.token_ids[0]
    for token in turn1.token_ids[:-1]:
        runner.step([StepItem(0, [token])])
    out = [int(runner.step([StepItem(0, [turn1.token_ids[-1], *message])])[0].argmax())]
    for _ in range(5):
        out.append(int(runner.step([StepItem(0, [out[-1]])])[0].argmax()))
    assert turn2.token_ids == out
    engine.clear_prefix_cache()
    assert engine.cache.memory_usage()["fast"] == 0


def test_kept_sequences_are_evicted_before_anyone_is_preempted():
    _, model = make_pair("llama_gqa")
    # Four residual slots (more than the pages can fill at once), so pages run out first.
    spec = "kivi:bits=2,group=4,residual=8,max_sequences=4"
    per_sequence = create_cache(spec, model.cache_layout(), 1 << 22, torch.float32).memory.sequence_bytes(40)
    engine = _engine(model, spec, budget=int(2.5 * per_sequence), batched=16)
    prompts = [torch.randint(3, 90, (30,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    for prompt in prompts:  # one at a time: each keeps a snapshot, evicted later for the next
        _run(engine, [prompt])
    stats = engine.prefix_statistics()
    assert stats["prefix_evicted_sequences"] >= 1 and engine.scheduler.num_preemptions == 0
    assert engine.prefix.kept_sequences <= 2


def test_prefix_caching_off_finds_nothing_and_keeps_nothing():
    _, model = make_pair("llama_gqa")
    engine = _engine(model, "kivi:bits=2,group=4,residual=8", prefix=False)
    prompt = _shared_prompts(count=1)[0]
    _run(engine, [prompt])
    _run(engine, [prompt + [5, 6]])
    assert engine.prefix_statistics() == {} and engine.cache.memory_usage()["fast"] == 0
