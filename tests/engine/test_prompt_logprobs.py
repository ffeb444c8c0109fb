"""Prompt log-probabilities computed by the engine (what `echo` + `logprobs` serves):
defined as log_softmax of the row before each prompt token, whatever the chunking, batch
or preemption, and top alternatives in order."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair
from test_engine import make_engine, prompts_of, run_all

from kvforge.cache.registry import create_cache
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.engine.sampling import SamplingParams


def _definition(prompt: list[int]) -> tuple[list[float], torch.Tensor]:
    """Every prompt row's logits in one step of a fresh cache: log p(prompt[i] | prompt[:i])."""
    _, model = make_pair("llama_gqa")
    runner = ModelRunner(model, create_cache("full:block_size=4", model.cache_layout(), 1 << 22, torch.float32))
    logprobs = runner.step([StepItem(0, prompt, num_logits=len(prompt))]).float().log_softmax(-1)
    return [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))], logprobs


@pytest.mark.parametrize("batched_tokens", [7, 16, 256])
def test_prompt_logprobs_match_the_definition_for_any_chunking(batched_tokens):
    prompts = prompts_of([1, 23, 40, 9], seed=3)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    outs, _ = run_all(make_engine(batched_tokens=batched_tokens), [(p, params) for p in prompts])
    for prompt, out in zip(prompts, outs):
        expected, logprobs = _definition(prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        assert len(out.prompt_top_logprobs) == len(prompt) and out.prompt_top_logprobs[0] == []
        assert out.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-5)
        for position in range(1, len(prompt)):
            top = out.prompt_top_logprobs[position]
            values, ids = logprobs[position - 1].topk(2)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)


def test_prompt_logprobs_survive_preemption_unchanged():
    _, model = make_pair("llama_gqa")
    per_sequence = create_cache("full:block_size=4", model.cache_layout(), 1 << 22,
                                torch.float32).memory.sequence_bytes(40 + 24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)
    prompts = prompts_of([40] * 6, seed=4)
    engine = make_engine(budget=2 * per_sequence, batched_tokens=64)
    tight, _ = run_all(engine, [(p, params) for p in prompts])
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, tight):
        assert out.prompt_logprobs[1:] == pytest.approx(_definition(prompt)[0], abs=1e-5)
        assert out.prompt_top_logprobs is None  # 0 alternatives asked


def test_generated_top_logprobs_lead_with_the_greedy_choice():
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3)
    (out,), _ = run_all(make_engine(), [(prompts_of([12])[0], params)])
    assert len(out.top_logprobs) == 6
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3 and top[0][0] == token and top[0][1] == pytest.approx(logprob)
        assert top[0][1] >= top[1][1] >= top[2][1]


def test_logprob_options_are_validated():
    from kvforge.errors import ConfigError

    with pytest.raises(ConfigError, match="top_logprobs.*needs logprobs"):
        SamplingParams(top_logprobs=2)
    with pytest.raises(ConfigError, match="top_logprobs"):
        SamplingParams(logprobs=True, top_logprobs=21)
    with pytest.raises(ConfigError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
