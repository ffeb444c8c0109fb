"""Streamed text against final text on the engine: the deltas of a request always join to
its text, a stop string that spans tokens never shows in a delta, text held back for a
stop string comes out once no stop can claim it (or when the request ends), and the stop
rules (stop strings from min_tokens on, a stop token's text left out).

The model is a tiny random Llama with a character tokenizer (tests/server_helpers.py):
every visible character is one token, so a stop string of k characters spans k tokens.
Greedy decoding is deterministic, so stop strings are cut from the text the model is known
to produce."""

from __future__ import annotations

import dataclasses
import random

import pytest
from server_helpers import make_engine, model_fixture, tokenizer_fixture  # noqa: F401 - fixtures

from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling import SamplingParams

PROMPT = "xyz"
MAX_TOKENS = 16


def run(model, tokenizer, requests: list[tuple[str, SamplingParams]]) -> list[list[RequestOutput]]:
    """Every output of each request, in order (all requests in one engine, batched)."""
    engine = make_engine(model, tokenizer)
    ids = [engine.add_request(tokenizer.encode(prompt), params) for prompt, params in requests]
    outputs: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return [outputs[i] for i in ids]


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def check_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """Each output's text is the join of the deltas so far, and only the last is finished;
    returns the last."""
    joined, token_ids = "", []
    for out in outputs:
        joined += out.new_text
        token_ids += out.new_token_ids
        assert out.text == joined and out.token_ids == token_ids
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    return outputs[-1]


@pytest.fixture(scope="module")
def free_run(model, tokenizer) -> RequestOutput:
    """The greedy run of PROMPT without stop strings."""
    (outputs,) = run(model, tokenizer, [(PROMPT, SamplingParams.greedy_params(MAX_TOKENS, ignore_eos=True))])
    final = check_deltas(outputs)
    assert final.finish_reason == "length" and len(final.text) >= 8
    return final


def first_unique(text: str, length: int, start: int = 2) -> int:
    """The first index >= start where text[i:i+length] occurs for the first time."""
    return next(i for i in range(start, len(text) - length) if text.find(text[i:i + length]) == i)


@pytest.mark.parametrize("length", [2, 3])
def test_a_stop_string_across_tokens_never_reaches_the_stream(model, tokenizer, free_run, length):
    text = free_run.text
    start = first_unique(text, length)
    stop = text[start:start + length]
    (outputs,) = run(model, tokenizer, [(PROMPT, SamplingParams.greedy_params(MAX_TOKENS, ignore_eos=True,
                                                                                stop=[stop]))])
    deltas = [out.new_text for out in outputs]
    assert "".join(deltas) == text[:start], f"stop {stop!r}: deltas {deltas}"
    final = check_deltas(outputs)
    assert final.text == text[:start] and final.finish_reason == "stop"


def test_text_held_for_a_stop_string_is_released_when_no_match_follows(model, tokenizer, free_run):
    """Two stop strings that never complete start with a character in the middle of the
    text and with its last one: each is held back while it ends the text, and comes out
    when the next character (or the end of the request) rules the stop out."""
    text = free_run.text
    middle, last = text[first_unique(text, 1)], text[-1]
    stops = [middle + "\x07", last + "\x07"]  # the character tokenizer never produces \x07
    (outputs,) = run(model, tokenizer, [(PROMPT, SamplingParams.greedy_params(MAX_TOKENS, ignore_eos=True,
                                                                                stop=stops))])
    final = check_deltas(outputs)
    assert final.text == text and final.finish_reason == "length"
    assert final.token_ids == free_run.token_ids
    for out in outputs[:-1]:
        generated = decode(tokenizer, out.token_ids)
        assert out.text == (generated[:-1] if generated.endswith((middle, last)) else generated)
    assert any(out.new_text.startswith(middle) for out in outputs[:-1])  # released mid-stream
    assert final.new_text.endswith(last)


def test_an_aborted_request_releases_its_held_text(model, tokenizer, free_run):
    text = free_run.text
    held = text[first_unique(text, 1)]
    engine = make_engine(model, tokenizer)
    request_id = engine.add_request(tokenizer.encode(PROMPT), SamplingParams.greedy_params(
        MAX_TOKENS, ignore_eos=True, stop=[held + "\x07"]))
    outputs = []
    while not outputs or decode(tokenizer, outputs[-1].token_ids) != text[:text.index(held) + 1]:
        (out,) = engine.step()
        outputs.append(out)
    assert outputs[-1].text == text[:text.index(held)]  # the held character is not out yet
    (aborted,) = engine.abort_request(request_id)
    assert aborted.finish_reason == "abort" and aborted.new_text == held
    check_deltas([*outputs, aborted])


def test_a_stop_string_counts_only_from_min_tokens_on(model, tokenizer, free_run):
    """A stop string that ends in the text of token p stops the request when min_tokens <=
    p, and never once it has gone by before min_tokens (the text is not cut later)."""
    text = free_run.text
    start = first_unique(text, 2)
    stop = text[start:start + 2]
    assert text.find(stop, start + 1) < 0
    ends_at = next(n for n in range(1, MAX_TOKENS + 1)
                   if len(decode(tokenizer, free_run.token_ids[:n])) >= start + 2)
    for min_tokens, expected, reason in ((ends_at, text[:start], "stop"), (ends_at + 1, text, "length")):
        params = SamplingParams.greedy_params(MAX_TOKENS, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
        (outputs,) = run(model, tokenizer, [(PROMPT, params)])
        final = check_deltas(outputs)
        assert (final.text, final.finish_reason) == (expected, reason), f"min_tokens={min_tokens}"


def test_a_stop_token_ends_the_request_without_its_text(model, tokenizer, free_run):
    visible = [t for t in free_run.token_ids if decode(tokenizer, [t])]
    stop_id = visible[2]
    first = free_run.token_ids.index(stop_id)
    params = SamplingParams.greedy_params(MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop_id])
    (outputs,) = run(model, tokenizer, [(PROMPT, params)])
    final = check_deltas(outputs)
    assert final.token_ids == free_run.token_ids[:first + 1] and final.finish_reason == "stop"
    assert final.text == decode(tokenizer, free_run.token_ids[:first])


def cut_at_first_stop(pieces: list[str], stops: list[str]) -> tuple[str, int] | None:
    """(text, tokens) where a stop string first completes in the per-token `pieces`: the
    text up to the earliest start among the stops found once that token's piece is added."""
    text = ""
    for count, piece in enumerate(pieces, 1):
        text += piece
        starts = [text.find(s) for s in stops if s in text]
        if starts:
            return text[:min(starts)], count
    return None


@pytest.mark.parametrize("seed", range(3))
def test_random_requests_stream_their_text_and_stop_where_a_stop_first_completes(model, tokenizer, seed):
    """Several requests at once (greedy and seeded sampling), each run without stops and
    with 1-3 stop strings of 1-4 characters taken from its free text (some made never to
    complete): deltas join to the text; the stopped run is the free run cut where a stop
    string first completes, or the free run itself when none does."""
    rng = random.Random(seed)
    prompts = ["".join(rng.choice("abcdefgh xyz") for _ in range(rng.randint(2, 12))) for _ in range(5)]
    free_params = [SamplingParams(max_tokens=rng.randint(6, 20), ignore_eos=True, logprobs=True,
                                  temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.choice([1.0, 0.9]),
                                  top_k=rng.choice([0, 20]), seed=rng.randrange(1000)) for _ in prompts]
    free = [check_deltas(outs) for outs in run(model, tokenizer, list(zip(prompts, free_params)))]
    stops = []
    for out in free:
        chosen = []
        for _ in range(rng.randint(1, 3)):
            length = rng.randint(1, 4)
            begin = rng.randrange(max(1, len(out.text) - length + 1))
            chosen.append(out.text[begin:begin + length] or "#")
        if rng.random() < 0.4:  # stops that never complete: their starts are held, then released
            chosen = [stop + "\x07" for stop in chosen]
        stops.append(chosen)
    stopped_params = [dataclasses.replace(p, stop=tuple(s)) for p, s in zip(free_params, stops)]
    stopped = run(model, tokenizer, list(zip(prompts, stopped_params)))
    for out, stop, outputs in zip(free, stops, stopped):
        final = check_deltas(outputs)
        pieces = [decode(tokenizer, out.token_ids[:n]) for n in range(len(out.token_ids) + 1)]
        cut = cut_at_first_stop([b[len(a):] for a, b in zip(pieces, pieces[1:])], stop)
        if cut is None:
            assert (final.text, final.token_ids, final.finish_reason) == (out.text, out.token_ids, "length")
        else:
            text, count = cut
            assert (final.text, final.token_ids, final.finish_reason) == (text, out.token_ids[:count], "stop")
        assert final.logprobs == out.logprobs[:len(final.token_ids)]
