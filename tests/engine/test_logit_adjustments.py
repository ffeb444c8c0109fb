"""OpenAI's logit_bias, frequency_penalty and presence_penalty in the sampler, checked
against their definitions on hand-made logits: the bias adds to its ids' logits; an id
generated c > 0 times so far loses c * frequency + presence (the prompt does not count);
bias, then repetition, then frequency and presence (vLLM's order); greedy rows too; each
row alone; the log-probabilities stay the model's own."""

from __future__ import annotations

import math

import pytest
import torch

from kvforge.engine.logit_adjustments import adjust_logits, adjusts_logits, penalize_frequency_and_presence
from kvforge.engine.sampling import SamplingParams, make_generator, sample
from kvforge.errors import ConfigError

DRAWS = 400


def test_frequency_and_presence_follow_openais_formula():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    penalize_frequency_and_presence(row, [0, 3, 3, 3, 99, -2], frequency=0.5, presence=0.25)  # 99, -2 outside
    by_hand = [2.0 - (1 * 0.5 + 0.25), -1.0, 0.5, 3.0 - (3 * 0.5 + 0.25), 0.0]
    assert row.tolist() == by_hand
    negative = torch.tensor([1.0, 1.0])
    penalize_frequency_and_presence(negative, [1, 1], frequency=-1.0, presence=-0.5)  # below 0 favours repeats
    assert negative.tolist() == [1.0, 3.5]


def test_bias_then_repetition_then_frequency_and_presence():
    params = SamplingParams(logit_bias={0: -3.0, 2: 1.5, 7: 9.0}, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)
    row = torch.tensor([1.0, 4.0, 0.5, -1.0])
    adjust_logits(row, params, seen=[0, 1], generated=[1, 1])  # id 7 lies outside the 4-id vocabulary
    # id 0: 1 - 3 = -2, seen: * 2 = -4 (dividing first would give 0.5 - 3 = -2.5)
    # id 1: 4 / 2 = 2, generated twice: 2 - (2 * 0.5 + 0.25) = 0.75; id 2: 0.5 + 1.5 = 2
    assert row.tolist() == [-4.0, 0.75, 2.0, -1.0]


def test_the_prompt_does_not_count_for_frequency_and_presence():
    logits = torch.tensor([[3.0, 2.5, -9.0]])
    params = SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    assert sample(logits, [params], generated=[[]]).token_ids == [0]  # 0 is in the prompt only
    assert sample(logits, [params], generated=[[0]]).token_ids == [1]  # 3 - 4 < 2.5


def test_greedy_rows_follow_the_bias_and_each_row_only_its_own():
    logits = torch.tensor([[3.0, 2.5, -9.0], [3.0, 2.5, -9.0]])
    plain = SamplingParams(temperature=0)
    biased = SamplingParams(temperature=0, logit_bias={2: 100.0})
    assert sample(logits, [plain, biased]).token_ids == [0, 2]
    banned_top = SamplingParams(temperature=0, logit_bias={0: -100.0})
    assert sample(logits, [banned_top, plain]).token_ids == [1, 0]


def test_sampling_with_adjustments_is_sampling_from_the_adjusted_logits():
    logits = torch.tensor([1.5, -0.5, 0.8, 0.1, -2.0])
    generated = [0, 0, 3]
    by_hand = torch.tensor([1.5 - (2 * 0.6 + 0.3) + 0.4, -0.5, 0.8 - 1.0, 0.1 - (0.6 + 0.3), -2.0])
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        adjusted = SamplingParams(temperature=temperature, top_p=top_p, frequency_penalty=0.6, presence_penalty=0.3,
                                  logit_bias={0: 0.4, 2: -1.0})
        plain = SamplingParams(temperature=temperature, top_p=top_p)
        ours = [sample(logits.unsqueeze(0), [adjusted], [make_generator(s)], generated=[generated]).token_ids[0]
                for s in range(DRAWS)]
        theirs = [sample(by_hand.unsqueeze(0), [plain], [make_generator(s)]).token_ids[0] for s in range(DRAWS)]
        untouched = [sample(logits.unsqueeze(0), [plain], [make_generator(s)]).token_ids[0] for s in range(DRAWS)]
        assert ours == theirs and ours != untouched


def test_logprobs_stay_those_of_the_raw_logits():
    logits = torch.tensor([[3.0, 2.5, -9.0]])
    params = SamplingParams(temperature=0, logprobs=True, logit_bias={1: 5.0})
    out = sample(logits, [params])
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())


def test_a_penalised_row_needs_its_output_ids():
    with pytest.raises(ConfigError, match="generated"):
        sample(torch.zeros(2, 4), [SamplingParams(), SamplingParams(presence_penalty=0.5)], generated=[[1], None])


def test_a_bias_is_bounded_in_size():
    assert len(SamplingParams(logit_bias=dict.fromkeys(range(1024), 1.0)).logit_bias) == 1024
    with pytest.raises(ConfigError, match="at most 1024"):
        SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0))


def test_counts_and_ids_of_the_output_penalise_alike():
    by_ids, by_counts = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0])
    penalize_frequency_and_presence(by_ids, [2, 0, 2], frequency=0.5, presence=0.25)
    penalize_frequency_and_presence(by_counts, {2: 2, 0: 1, 1: 0}, frequency=0.5, presence=0.25)  # 0 times: absent
    assert by_ids.tolist() == by_counts.tolist() == [0.25, 2.0, 1.75]


def test_neutral_values_do_nothing():
    assert not adjusts_logits(SamplingParams(frequency_penalty=0, presence_penalty=0.0, logit_bias={}))
    assert adjusts_logits(SamplingParams(logit_bias={3: 0.0}))  # a bias of 0 is still a request for one
    assert SamplingParams(logit_bias={5: 1, 2: -0.5}).logit_bias == ((2, -0.5), (5, 1.0))
    assert SamplingParams(logit_bias=[(2, 1.0)]).logit_bias == ((2, 1.0),)


@pytest.mark.parametrize("field, value, rule", [
    ("frequency_penalty", 2.5, "[-2, 2]"), ("presence_penalty", -2.01, "[-2, 2]"),
    ("presence_penalty", math.nan, "[-2, 2]"), ("frequency_penalty", True, "[-2, 2]"),
    ("frequency_penalty", "1", "[-2, 2]"),
    ("logit_bias", {-1: 1.0}, ">= 0"), ("logit_bias", {True: 1.0}, ">= 0"), ("logit_bias", {"5": 1.0}, ">= 0"),
    ("logit_bias", {5: 100.5}, "[-100, 100]"), ("logit_bias", {5: math.inf}, "[-100, 100]"),
    ("logit_bias", {5: "x"}, "[-100, 100]"), ("logit_bias", [(1, 1.0), (1, 2.0)], "once"),
    ("logit_bias", 7, "map token ids"), ("logit_bias", [(1, 2, 3)], "map token ids"),
])
def test_bad_values_are_refused_by_name(field, value, rule):
    with pytest.raises(ConfigError, match="logit_bias|penalty") as error:
        SamplingParams(**{field: value})
    assert rule in str(error.value) and field.split("_")[0] in str(error.value)


def test_the_engine_refuses_a_bias_outside_the_vocabulary_and_keeps_nothing():
    from server_helpers import VOCAB, char_tokenizer, make_engine, tiny_model

    engine = make_engine(tiny_model(), char_tokenizer())
    with pytest.raises(ConfigError, match=rf"logit_bias token id.*{VOCAB}.*\[0, {VOCAB}\)"):
        engine.add_request([5, 6], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert not engine.has_unfinished_requests()
    engine.add_request([5, 6], SamplingParams(max_tokens=2, logit_bias={VOCAB - 1: 1.0}))  # the last id is fine
    assert engine.has_unfinished_requests()


# -- vLLM's allowed_token_ids -------------------------------------------------------------------
def test_only_allowed_ids_are_ever_chosen_and_a_bias_cannot_bring_another_back():
    logits = torch.tensor([3.0, 2.5, 1.0, 0.5, -1.0])
    greedy = SamplingParams(temperature=0, allowed_token_ids=[2, 4])
    assert sample(logits.unsqueeze(0), [greedy]).token_ids == [2]
    sampled = SamplingParams(temperature=2.0, allowed_token_ids=[1, 3, 4], logit_bias={0: 100.0})
    drawn = {sample(logits.unsqueeze(0), [sampled], [make_generator(s)]).token_ids[0] for s in range(DRAWS)}
    assert drawn == {1, 3, 4}
    row = logits.clone()
    adjust_logits(row, SamplingParams(allowed_token_ids=[1, 99]), None, None)  # 99 lies outside the row
    assert row.tolist() == [-math.inf, 2.5, -math.inf, -math.inf, -math.inf]


@pytest.mark.parametrize("value, rule", [([], "at least one"), ([-1], "integers >= 0"), ([True], "integers >= 0"),
                                         (["3"], "integers >= 0"), ("3", "a list"), ({3: 1}, "a list")])
def test_bad_allowed_ids_are_refused_by_name(value, rule):
    with pytest.raises(ConfigError, match="allowed_token_ids") as error:
        SamplingParams(allowed_token_ids=value)
    assert rule in str(error.value)


def test_the_engine_refuses_allowed_ids_it_cannot_honour():
    from server_helpers import VOCAB, char_tokenizer, make_engine, tiny_model

    engine = make_engine(tiny_model(), char_tokenizer())
    with pytest.raises(ConfigError, match=rf"allowed_token_ids.*{VOCAB}"):
        engine.add_request([5, 6], SamplingParams(allowed_token_ids=[3, VOCAB]))
    eos = sorted(engine.eos_token_ids)
    with pytest.raises(ConfigError, match="min_tokens=2"):  # every allowed id banned until 2 tokens exist
        engine.add_request([5, 6], SamplingParams(allowed_token_ids=eos, min_tokens=2, stop_token_ids=[9]))
    assert not engine.has_unfinished_requests()
    engine.add_request([5, 6], SamplingParams(allowed_token_ids=eos, max_tokens=2))  # no min_tokens: fine
    forced = engine.add_request([5, 6], SamplingParams(allowed_token_ids=[*eos, 7], min_tokens=2, max_tokens=3))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs[forced].token_ids[:2] == [7, 7]  # the one allowed id min_tokens leaves
