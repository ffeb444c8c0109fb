"""vLLM's repetition_penalty and min_p in the sampler, checked against their definitions
on hand-made logits: the penalty divides the positive logits and multiplies the negative
logits of every id seen in the prompt or output (greedy rows too); min_p drops, after
temperature, every id whose probability is below min_p times the top id's. At 1.0 and 0.0
they leave every choice bitwise unchanged and the greedy fast path in use."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvforge.engine import sampling
from kvforge.engine.sampling import SamplingParams, keep_min_p, make_generator, penalize_repetition, sample
from kvforge.errors import ConfigError

DRAWS = 400


def draws(logits: torch.Tensor, params: SamplingParams, seen: list[int] | None = None) -> list[int]:
    """One token from each of DRAWS seeded generators (the same seeds in every call)."""
    return [sample(logits.unsqueeze(0), [params], [make_generator(seed)], seen=[seen]).token_ids[0]
            for seed in range(DRAWS)]


def test_the_penalty_divides_positive_and_multiplies_negative_logits_of_seen_ids_once():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0, -4.0])
    penalize_repetition(row, [0, 1, 1, 4, 99, -5], 2.0)  # 1 twice; 99 and -5 outside the vocabulary
    assert row.tolist() == [1.0, -2.0, 0.5, 3.0, 0.0, -4.0]
    boosted = torch.tensor([2.0, -1.0])
    penalize_repetition(boosted, [0, 1], 0.5)  # below 1 favours the seen ids
    assert boosted.tolist() == [4.0, -0.5]


def test_greedy_rows_are_penalised_before_the_argmax():
    logits = torch.tensor([[3.0, 2.5, -9.0], [-1.0, -1.5, -9.0]])
    plain = sample(logits, [SamplingParams(temperature=0)] * 2).token_ids
    assert plain == [0, 0]
    penalised = sample(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)] * 2, seen=[[0], [0, 2]])
    assert penalised.token_ids == [1, 1]  # 3/2 < 2.5 and -1*2 < -1.5
    assert penalised.logprobs == [None, None]


def test_sampling_with_the_penalty_is_sampling_from_the_penalised_logits():
    logits = torch.tensor([1.5, -0.5, 0.8, 0.1, -2.0])
    seen = [0, 1, 3]
    by_hand = torch.tensor([1.5 / 1.7, -0.5 * 1.7, 0.8, 0.1 / 1.7, -2.0])
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        params = SamplingParams(temperature=temperature, top_p=top_p)
        penalised = SamplingParams(temperature=temperature, top_p=top_p, repetition_penalty=1.7)
        assert draws(logits, penalised, seen) == draws(by_hand, params)
        assert draws(logits, penalised, seen) != draws(logits, params)


def test_a_penalised_row_needs_its_seen_ids():
    with pytest.raises(ConfigError, match="seen"):
        sample(torch.zeros(2, 4), [SamplingParams(), SamplingParams(repetition_penalty=1.3)], seen=[[1], None])


def test_min_p_drops_ids_below_min_p_times_the_top_probability_after_temperature():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # temperature 1: the bar is 0.5 * 0.5 = 0.25, so ids 0 and 1 stay
    kept = draws(logits, SamplingParams(temperature=1.0, min_p=0.5))
    assert set(kept) == {0, 1}
    masked = logits.clone()
    masked[2:] = -math.inf
    assert kept == draws(masked, SamplingParams(temperature=1.0))
    # temperature 2 flattens first (p ~ sqrt(p): 0.15 -> 0.548 of the top), so id 2 stays too:
    # min_p applied before temperature would have dropped it (0.15 / 0.5 = 0.3 < 0.5)
    assert set(draws(logits, SamplingParams(temperature=2.0, min_p=0.5))) == {0, 1, 2}


def test_keep_min_p_keeps_exactly_the_ids_at_or_above_the_bar():
    scaled = torch.tensor([0.0, math.log(0.5), math.log(0.25), math.log(0.1)])
    assert keep_min_p(scaled, 0.2).isfinite().tolist() == [True, True, True, False]
    assert keep_min_p(scaled, 1.0).isfinite().tolist() == [True, False, False, False]


def test_min_p_one_is_greedy_and_min_p_is_ignored_by_greedy_rows():
    logits = torch.tensor([0.3, 1.9, 1.2, -0.4])
    assert set(draws(logits, SamplingParams(temperature=1.5, min_p=1.0))) == {1}
    assert draws(logits, SamplingParams(temperature=0, min_p=0.9)) == [1] * DRAWS


def test_neutral_values_leave_sampling_bitwise_unchanged_and_the_fast_path_in_use(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    for base in (dict(temperature=0.8), dict(temperature=1.2, top_k=10), dict(temperature=0.9, top_p=0.7)):
        plain = [sample(logits, [SamplingParams(**base)] * 3, [make_generator(s) for s in range(3)]).token_ids
                 for _ in range(5)]
        neutral = [sample(logits, [SamplingParams(**base, min_p=0.0, repetition_penalty=1.0)] * 3,
                          [make_generator(s) for s in range(3)], seen=[[1, 2], None, [3]]).token_ids
                   for _ in range(5)]
        assert plain == neutral
    calls = []
    real = sampling.argmax_rows
    monkeypatch.setattr(sampling, "argmax_rows", lambda x: calls.append(1) or real(x))
    sample(logits, [SamplingParams(temperature=0, repetition_penalty=1.0, min_p=0.0)] * 3)
    assert calls == [1]  # neutral values keep the one-pass greedy path
    sample(logits, [SamplingParams(temperature=0, repetition_penalty=1.1)] * 3, seen=[[0]] * 3)
    assert calls == [1]  # a penalty needs the float copy, so not the fast path


@pytest.mark.parametrize("name, value, rule", [
    ("repetition_penalty", 0, "> 0"), ("repetition_penalty", -1.0, "> 0"),
    ("repetition_penalty", math.nan, "finite"), ("repetition_penalty", math.inf, "finite"),
    ("repetition_penalty", True, "> 0"), ("min_p", -0.1, "[0, 1]"), ("min_p", 1.5, "[0, 1]"),
    ("min_p", math.nan, "[0, 1]"), ("min_p", "0.1", "[0, 1]"),
])
def test_bad_values_name_the_parameter_the_value_and_the_rule(name, value, rule):
    with pytest.raises(ConfigError) as caught:
        SamplingParams(**{name: value})
    assert caught.value.parameter == name and rule in str(caught.value) and repr(value)[:3] in str(caught.value)


def test_the_engine_gives_the_sampler_the_prompt_and_the_output_so_far(monkeypatch):
    """The repetition penalty reads prompt and output ids; frequency and presence read the
    output alone (logit_adjustments.py); a request without penalties builds no list."""
    from server_helpers import char_tokenizer, make_engine, tiny_model

    from kvforge.engine import llm_engine

    recorded = []
    real = llm_engine.sample

    def spy(logits, params, generators, banned, seen, generated, allowed):
        recorded.append([[list(ids) if ids is not None else None for ids in seen],
                         [dict(counts) if counts is not None else None for counts in generated]])  # (live: copied)
        assert allowed is None  # no request is constrained
        return real(logits, params, generators, banned, seen, generated, allowed)

    monkeypatch.setattr(llm_engine, "sample", spy)
    tokenizer = char_tokenizer()
    engine = make_engine(tiny_model(), tokenizer)
    prompt = tokenizer.encode("abcab")
    penalised = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, repetition_penalty=1.5,
                                                          ignore_eos=True))
    engine.add_request(tokenizer.encode("xy"), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    # the bias makes it repeat one id: the counts then have more than ones to get right
    by_frequency = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, frequency_penalty=1.0,
                                                             logit_bias={5: 100.0}, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    generated, frequency_generated = outputs[penalised].token_ids, outputs[by_frequency].token_ids
    assert len(set(frequency_generated)) < len(frequency_generated)
    assert len(recorded) == 4
    for step, (seen, output) in enumerate(recorded):
        assert seen[0] == prompt + generated[:step] and output[0] is None  # the repetition penalty's history
        assert seen[1] is None and output[1] is None  # a request without a penalty builds no list
        assert seen[2] is None and output[2] == Counter(frequency_generated[:step])  # the output alone, counted


@pytest.mark.parametrize("temperature", [9.631634438219779e-257, 1e-300, 5e-6])
def test_a_vanishing_temperature_is_greedy(temperature):
    """Found by the server's bad-body generator: dividing float32 logits by 1e-256 divides by
    zero (the NaN row drew id V, out of range, and the step failed). Below GREEDY_TEMPERATURE a
    temperature is greedy, as vLLM's."""
    logits = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=temperature)] * 3
    assert all(p.greedy for p in params)
    out = sample(logits, params, [torch.Generator().manual_seed(0)] * 3)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
