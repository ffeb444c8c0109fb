"""Sampling: parameter validation, greedy/top-k/top-p/temperature, per-request seeds,
banned ids, raw-model logprobs and stop-string search."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvforge.engine.sampling import (
    SamplingParams,
    banned_token_ids,
    make_generator,
    sample,
)
from kvforge.engine.stop_strings import find_stop_match
from kvforge.errors import ConfigError


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0,
           banned=None) -> list[int]:
    """n draws from one row, all from one generator."""
    gen = make_generator(seed, "cpu")
    return [sample(logits, [params], [gen], banned=[banned]).token_ids[0] for _ in range(n)]


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", True),
    ("min_tokens", -1), ("temperature", -0.1), ("temperature", float("nan")),
    ("temperature", float("inf")), ("top_k", -1), ("top_k", 2.0), ("top_p", 0.0), ("top_p", 1.01),
    ("top_p", float("nan")), ("seed", -1), ("seed", 1.0), ("seed", 2**64),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop", [""]), ("stop", ""), ("stop", [3]),
    ("ignore_eos", 1), ("logprobs", "yes"),
])
def test_bad_field_is_refused_with_its_name(field, value):
    with pytest.raises(ConfigError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.parameter == field


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_sequences_are_stored_as_tuples_and_greedy_property():
    params = SamplingParams(stop_token_ids=[3, 4], stop="END", temperature=1)
    assert params.stop_token_ids == (3, 4) and params.stop == ("END",)
    assert isinstance(params.temperature, float)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy
    greedy = SamplingParams.greedy_params(max_tokens=7, seed=3)
    assert greedy.greedy and greedy.max_tokens == 7 and greedy.seed == 3
    hash(params)  # frozen and hashable


def test_banned_token_ids_follow_min_tokens_and_ignore_eos():
    params = SamplingParams(min_tokens=2, stop_token_ids=[5])
    assert banned_token_ids(params, [1, 2], 0) == {1, 2, 5}
    assert banned_token_ids(params, [1, 2], 2) == frozenset()
    ignoring = SamplingParams(min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert banned_token_ids(ignoring, [1, 2], 1) == {5}


# ---------------------------------------------------------------- choice rules
def test_greedy_is_argmax_with_lowest_index_on_ties():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1
    out = sample(logits, [SamplingParams(temperature=0)] * 5)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 7
    assert out.logprobs == [None] * 5


def test_top_k_one_equals_greedy_and_ignores_generator_state():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    gens = [make_generator(i) for i in range(4)]
    before = [g.get_state() for g in gens]
    out = sample(logits, [SamplingParams(top_k=1, temperature=1.3)] * 4, gens)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert all(torch.equal(b, g.get_state()) for b, g in zip(before, gens))


def test_top_k_never_samples_outside_the_k_best():
    torch.manual_seed(2)
    logits = torch.randn(1, 64)
    best = set(logits[0].topk(5).indices.tolist())
    drawn = Counter(_draws(logits, SamplingParams(top_k=5, temperature=2.0), 2000))
    assert set(drawn) == best  # only those, and all of them at temperature 2


@pytest.mark.parametrize("top_p, expected", [(0.8, {0, 1}), (0.81, {0, 1, 2}), (0.5, {0}),
                                             (0.1, {0}), (0.96, {0, 1, 2, 3})])
def test_top_p_keeps_exactly_the_nucleus(top_p, expected):
    # rank r (probs 0.5, 0.3, 0.15, 0.05) lives at token id_of_rank[r], so the nucleus must
    # be found by sorting, not by position
    id_of_rank = [2, 0, 3, 1]
    logits = _probs_logits([0.3, 0.05, 0.5, 0.15])
    drawn = Counter(_draws(logits, SamplingParams(top_p=top_p), 3000))
    assert set(drawn) == {id_of_rank[r] for r in expected}
    if expected == {0, 1}:  # renormalised over the nucleus: 0.5 / 0.8
        assert abs(drawn[id_of_rank[0]] / 3000 - 0.625) < 0.04


def test_top_p_partial_candidates_and_full_sort_agree(monkeypatch):
    """The nucleus found among the best few candidates equals the one from a full sort."""
    from kvforge.engine import sampling

    torch.manual_seed(7)
    logits = torch.randn(1, 300)
    params = SamplingParams(top_p=0.7, temperature=0.8)
    runs = []
    for candidates in (4, 64, 10**9):  # 4: never enough, falls back to sorting everything
        monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", candidates)
        runs.append(_draws(logits, params, 300, seed=9))
    assert runs[0] == runs[1] == runs[2]
    assert len(set(runs[0])) > 4  # the nucleus is larger than 4 tokens here


def test_top_k_then_top_p_renormalises_over_the_k_best():
    # top-2 of [0.4, 0.3, 0.2, 0.1] renormalised: [4/7, 3/7]; top_p=0.5 keeps token 0 only
    logits = _probs_logits([0.4, 0.3, 0.2, 0.1])
    assert set(_draws(logits, SamplingParams(top_k=2, top_p=0.5), 500)) == {0}
    assert set(_draws(logits, SamplingParams(top_k=3, top_p=0.75), 2000)) == {0, 1}


def test_plain_sampling_follows_the_distribution_without_sorting(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("full sort for a row without top-k/top-p")
    monkeypatch.setattr(torch, "sort", forbidden)
    monkeypatch.setattr(torch, "argsort", forbidden)
    probs = [0.5, 0.3, 0.15, 0.05]
    drawn = Counter(_draws(_probs_logits(probs), SamplingParams(), 4000))
    for token, p in enumerate(probs):
        assert abs(drawn[token] / 4000 - p) < 0.03
    # temperature 0.5 squares the probabilities: [25, 9, 2.25, 0.25] / 36.5
    drawn = Counter(_draws(_probs_logits(probs), SamplingParams(temperature=0.5), 4000))
    assert abs(drawn[0] / 4000 - 25 / 36.5) < 0.03


def test_temperature_to_zero_becomes_argmax():
    torch.manual_seed(3)
    logits = torch.randn(3, 200) * 5
    for temperature in (1e-3, 1e-8, 1e-30):
        gens = [make_generator(i) for i in range(3)]
        out = sample(logits, [SamplingParams(temperature=temperature)] * 3, gens)
        assert out.token_ids == logits.argmax(dim=-1).tolist()


# ---------------------------------------------------------------- reproducibility
def test_same_seed_gives_the_same_sequence_of_draws():
    torch.manual_seed(4)
    steps = torch.randn(20, 1, 500)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42)

    def run(seed):
        gen = make_generator(seed)
        return [sample(step, [params], [gen]).token_ids[0] for step in steps]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_row_gives_the_same_tokens_alone_or_inside_any_batch():
    torch.manual_seed(5)
    steps = torch.randn(30, 4, 300)
    target = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=1),
              SamplingParams(top_p=0.5, seed=2, logprobs=True)]

    alone_gen = make_generator(7)
    alone = [sample(step[2:3], [target], [alone_gen]).token_ids[0] for step in steps]

    gens = [make_generator(11), make_generator(1), make_generator(7), make_generator(2)]
    batch_params = [others[1], others[0], target, others[2]]
    banned = [{0, 1}, None, None, {5}]
    in_batch = [sample(step, batch_params, gens, banned).token_ids[2] for step in steps]
    assert alone == in_batch
    assert len(set(alone)) > 5  # it really sampled


def test_make_generator_without_seed_is_nondeterministic():
    a, b = make_generator(None), make_generator(None)
    assert not torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    assert torch.equal(torch.rand(8, generator=make_generator(3)), torch.rand(8, generator=make_generator(3)))


# ---------------------------------------------------------------- banned ids, logprobs
def test_banned_ids_are_never_drawn():
    logits = _probs_logits([0.6, 0.3, 0.05, 0.05])
    assert sample(logits, [SamplingParams(temperature=0)], banned=[{0}]).token_ids == [1]
    drawn = set(_draws(logits, SamplingParams(temperature=3.0), 2000, banned={0, 2, 999, -1}))
    assert drawn == {1, 3}
    drawn = set(_draws(logits, SamplingParams(top_k=3, top_p=0.99), 1000, banned={1}))
    assert drawn == {0, 2, 3}
    assert torch.equal(logits, _probs_logits([0.6, 0.3, 0.05, 0.05]))  # caller's logits untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_at_the_chosen_ids(dtype):
    torch.manual_seed(6)
    logits = (torch.randn(4, 80) * 3).to(dtype)
    params = [SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=0.7, top_k=10, logprobs=True),
              SamplingParams(temperature=1.2),
              SamplingParams(top_p=0.6, logprobs=True)]
    gens = [make_generator(i) for i in range(4)]
    out = sample(logits, params, gens, banned=[{int(logits[0].float().argmax())}, None, None, None])
    reference = logits.float().log_softmax(dim=-1)
    for row, token in enumerate(out.token_ids):
        if params[row].logprobs:
            assert out.logprobs[row] == pytest.approx(reference[row, token].item(), abs=1e-5)
        else:
            assert out.logprobs[row] is None


def test_a_constraints_mask_counts_in_the_logprobs_and_nothing_else_does():
    """The definition (vLLM's: its grammar bitmask is applied before its raw logprobs): a
    constrained row's logprobs are log_softmax over the ids its mask allows, its alternatives
    are allowed ids only (fewer when fewer are allowed); a bias or a ban still changes
    nothing; an unconstrained row beside it keeps the raw distribution."""
    torch.manual_seed(7)
    logits = torch.randn(3, 60) * 2
    allowed = torch.zeros(60, dtype=torch.bool)
    allowed[[3, 11, 12, 40, 59]] = True
    params = [SamplingParams(temperature=1.0, logprobs=True, top_logprobs=8, logit_bias={11: 5.0}),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=8)]
    out = sample(logits, params, [make_generator(1), None, None], banned=[{3}, None, None],
                 allowed=[allowed, allowed, None])
    for row in (0, 1):
        masked = logits[row].masked_fill(~allowed, -math.inf).log_softmax(-1)
        token = out.token_ids[row]
        assert allowed[token] and out.logprobs[row] == pytest.approx(masked[token].item(), abs=1e-5)
        top = out.top_logprobs[row]
        assert [i for i, _ in top] == masked.topk(min(params[row].top_logprobs, 5)).indices.tolist()
        assert all(allowed[i] and value == pytest.approx(masked[i].item(), abs=1e-5) for i, value in top)
    assert len(out.top_logprobs[0]) == 5  # 8 asked, 5 allowed
    assert sum(math.exp(v) for _, v in out.top_logprobs[0]) == pytest.approx(1.0, abs=1e-5)
    raw = logits[2].log_softmax(-1)
    assert out.logprobs[2] == pytest.approx(raw[out.token_ids[2]].item(), abs=1e-5)
    assert [i for i, _ in out.top_logprobs[2]] == raw.topk(8).indices.tolist()


def test_shape_mismatches_are_refused():
    with pytest.raises(ConfigError, match="params"):
        sample(torch.zeros(2, 5), [SamplingParams()])
    with pytest.raises(ConfigError, match="generators"):
        sample(torch.zeros(1, 5), [SamplingParams()], [None, None])
    with pytest.raises(ConfigError, match="logits"):
        sample(torch.zeros(5), [SamplingParams()])


# ---------------------------------------------------------------- stop strings
def find_stop(text, stops, search_from):
    match = find_stop_match(text, stops, search_from)
    return None if match is None else match[0]


def test_find_stop():
    assert find_stop("STOP here", ["STOP"], 0) == 0  # at the start
    assert find_stop("no stop here", ["STOP", "xyz"], 0) is None
    # across the incremental boundary: "ST" was already seen, "OP" is new
    assert find_stop("abc ST", ["STOP"], 0) is None
    assert find_stop("abc STOP!", ["STOP"], len("abc ST")) == 4
    # several stops: the earliest start wins, whatever the list order
    assert find_stop("one two three", ["three", "two", "one two"], 0) == 0
    assert find_stop("xx two three", ["three", "two"], 3) == 3
    # a match wholly inside already-searched text is not reported again
    assert find_stop("END then more", ["END"], 8) is None
    assert find_stop("", ["a"], 0) is None and find_stop("abc", [], 0) is None


def test_the_nucleus_is_taken_after_the_temperature():
    """probs [0.5, 0.3, 0.2] keep two tokens at top_p 0.75; a high temperature flattens
    them so the nucleus holds all three, a low one sharpens them to the best alone."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()

    def draws(temperature: float) -> set[int]:
        params = SamplingParams(temperature=temperature, top_p=0.75, seed=0)
        generator = make_generator(0)
        return {sample(logits, [params], [generator]).token_ids[0] for _ in range(400)}

    assert draws(1.0) == {0, 1}
    assert draws(5.0) == {0, 1, 2}
    assert draws(0.2) == {0}
