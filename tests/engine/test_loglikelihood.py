"""Continuation log-likelihoods through ModelRunner batches (kvforge.engine.loglikelihood):
the pieces of each mode, agreement with transformers for the exact cache in every mode and
for any batching, and a compressed cache (KIVI) scoring what it stores."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair, make_runner

from kvforge.engine import loglikelihood
from kvforge.engine.loglikelihood import ScoreSettings, score_continuations, split_pieces
from kvforge.engine.runner import StepItem
from kvforge.errors import ConfigError

KIVI = "kivi:bits=2,group=8,residual=8"


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: thread wake-ups dominate otherwise
    yield make_pair("llama_gqa")
    torch.set_num_threads(threads)


def _requests(seed: int = 3) -> list[tuple[list[int], list[int]]]:
    """Contexts and continuations of varied lengths, one-token continuations included."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(1, 1), (1, 6), (5, 1), (30, 4), (12, 9), (45, 2), (3, 20)]
    return [(torch.randint(3, 96, (c,), generator=generator).tolist(),
             torch.randint(3, 96, (n,), generator=generator).tolist()) for c, n in shapes]


def _reference(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    ids = torch.tensor([context + continuation[:-1]])
    with torch.inference_mode():
        logp = torch.log_softmax(hf(input_ids=ids).logits[0].double(), dim=-1)[len(context) - 1:]
    target = torch.tensor(continuation)
    return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def test_pieces_cover_the_input_and_score_the_continuation():
    context, continuation = [10, 11, 12], [20, 21, 22]
    inputs = context + continuation[:-1]
    expected = {"prefill": [5], "cached": [3, 2], "decode": [3, 1, 1]}
    for mode, sizes in expected.items():
        pieces = split_pieces(context, continuation, mode, chunk=100)
        assert [len(p.tokens) for p in pieces] == sizes
        assert sum((p.tokens for p in pieces), []) == inputs
        assert sum((p.targets for p in pieces), []) == continuation
    chunked = split_pieces(context, continuation, "prefill", chunk=2)
    assert [p.tokens for p in chunked] == [[10, 11], [12, 20], [21]]
    assert [p.targets for p in chunked] == [[], [20, 21], [22]]
    assert [len(p.tokens) for p in split_pieces([1], [5], "cached", chunk=4)] == [1]


def test_settings_and_requests_validate(pair):
    with pytest.raises(ConfigError, match="score_mode"):
        ScoreSettings(mode="sideways")
    with pytest.raises(ConfigError, match="max_batch"):
        ScoreSettings(max_batch=0)
    runner = make_runner(pair[1])
    with pytest.raises(ConfigError, match="context"):
        score_continuations(runner, [([], [4])])
    with pytest.raises(ConfigError, match="continuation"):
        score_continuations(runner, [([4], [])])


@pytest.mark.parametrize("mode", ["prefill", "cached", "decode"])
@pytest.mark.parametrize("max_batch,max_batch_tokens", [(1, 2048), (4, 2048), (16, 24)])
def test_full_cache_matches_transformers(pair, mode, max_batch, max_batch_tokens):
    hf, ours = pair
    requests = _requests()
    settings = ScoreSettings(mode, max_batch, max_batch_tokens)
    done = []
    scores = score_continuations(make_runner(ours), requests, settings, done.append)
    assert sum(done) == len(requests)
    for (context, continuation), score in zip(requests, scores):
        logprob, greedy = _reference(hf, context, continuation)
        assert score.logprob == pytest.approx(logprob, abs=1e-4)
        assert score.is_greedy == greedy
        assert score.num_tokens == len(continuation)


@pytest.mark.parametrize("mode", ["prefill", "cached"])
def test_long_continuation_in_chunks_matches_transformers(pair, mode):
    """More rows than ROW_BLOCK, fed in pieces of max_batch_tokens."""
    hf, ours = pair
    generator = torch.Generator().manual_seed(9)
    context, continuation = [7, 8, 9], torch.randint(3, 96, (300,), generator=generator).tolist()
    [score] = score_continuations(make_runner(ours), [(context, continuation)], ScoreSettings(mode, 4, 128))
    assert score.logprob == pytest.approx(_reference(hf, context, continuation)[0], abs=1e-4)


def test_greedy_continuations_are_flagged(pair):
    hf, ours = pair
    context = [5, 17, 33, 60]
    greedy = []
    with torch.inference_mode():
        for _ in range(6):
            greedy.append(int(hf(input_ids=torch.tensor([context + greedy])).logits[0, -1].argmax()))
    other = greedy[:-1] + [(greedy[-1] + 1) % 96]
    for mode in ("prefill", "cached", "decode"):
        scores = score_continuations(make_runner(ours), [(context, greedy), (context, other)], ScoreSettings(mode))
        assert [s.is_greedy for s in scores] == [True, False]


def _one_at_a_time(model, cache: str, context: list[int], continuation: list[int], mode: str) -> float:
    """The steps of `mode` run by hand for one sequence on a fresh cache."""
    runner = make_runner(model, cache)
    rows = [runner.step([StepItem(0, context, 1)])]
    rest = continuation[:-1]
    if mode == "cached" and rest:
        rows.append(runner.step([StepItem(0, rest, len(rest))]))
    elif mode == "decode":
        rows += [runner.step([StepItem(0, [token], 1)]) for token in rest]
    logp = torch.log_softmax(torch.cat(rows).double(), dim=-1)
    return float(logp.gather(-1, torch.tensor(continuation)[:, None]).sum())


@pytest.mark.parametrize("mode", ["cached", "decode"])
def test_kivi_scores_what_it_stores(pair, mode):
    hf, ours = pair
    requests = _requests()
    kivi = score_continuations(make_runner(ours, KIVI), requests, ScoreSettings(mode, max_batch=4))
    full = score_continuations(make_runner(ours), requests, ScoreSettings(mode, max_batch=4))
    for (context, continuation), score in zip(requests, kivi):
        assert score.logprob == pytest.approx(_one_at_a_time(ours, KIVI, context, continuation, mode), abs=1e-4)
    # contexts longer than the residual read quantised keys/values: the scores move
    moved = [abs(k.logprob - f.logprob) for k, f, (c, _) in zip(kivi, full, requests) if len(c) > 16]
    assert moved and min(moved) > 1e-4
    # one step sees only exact K/V, whatever the method stores
    prefill = score_continuations(make_runner(ours, KIVI), requests, ScoreSettings("prefill"))
    exact = score_continuations(make_runner(ours), requests, ScoreSettings("prefill"))
    assert [s.logprob for s in prefill] == pytest.approx([s.logprob for s in exact], abs=1e-5)


def test_sequences_are_released(pair):
    runner = make_runner(pair[1])
    score_continuations(runner, _requests(), ScoreSettings("cached", first_seq_id=100))
    assert all(runner.cache.num_cached_tokens(100 + s) == 0 for s in range(len(_requests())))


def test_token_nll_in_row_chunks_equals_log_softmax(monkeypatch):
    """The chunked float64 NLL (bounded memory for large vocabularies) equals a whole
    log_softmax, across chunk boundaries and with a batch dimension."""
    monkeypatch.setattr(loglikelihood, "NLL_ROWS", 7)
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 30, 50), torch.randint(0, 50, (2, 30))
    expected = -torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(loglikelihood.token_nll(logits, targets), expected, atol=1e-12, rtol=0)
    assert loglikelihood.window_nll(logits[0], targets[0].tolist()) == pytest.approx(float(expected[0].sum()), abs=1e-9)
