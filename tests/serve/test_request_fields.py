"""How the fields of an OpenAI request become sampling parameters, and what the response
reports about them: stop as a string, the temperature default, top_k's off values, top_p,
min_tokens with stop_token_ids, max_tokens and max_completion_tokens, logprobs=0, echo's
text offsets, sampled tokens among the top logprobs, the model name and chat messages
rendered with the template.

Each test compares requests whose outputs must be equal (or differ) if the field is read
as OpenAI and vLLM define it; the model is the tiny random Llama of tests/server_helpers.py
with its character tokenizer."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from server_helpers import (
    CHAT_TEMPLATE,
    MODEL_NAME,
    make_engine,
    serve,
    tiny_model,
    tokenizer_fixture,  # noqa: F401 - fixtures
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SEEDS = range(4)


@pytest.fixture(scope="module")
def http(tokenizer):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with serve(make_engine(tiny_model(), tokenizer), tokenizer) as running:
        with httpx.Client(base_url=running.base_url, timeout=60) as client:
            yield client
    torch.set_num_threads(threads)


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    """The one choice of a completion of "xyz" (ignore_eos, token ids returned)."""
    response = http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "xyz", "ignore_eos": True,
                                            "return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    return {**response.json()["choices"][0], "usage": response.json()["usage"]}


def test_a_stop_string_is_one_stop_not_its_characters(http):
    text = complete(http, max_tokens=16, temperature=0)["text"]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text.find(text[i:i + 2]) == i
                and text[i] not in text[:i] and text[i + 1] not in text[:i])
    as_string = complete(http, max_tokens=16, temperature=0, stop=stop)
    assert as_string["text"] == text[:text.index(stop)] and as_string["finish_reason"] == "stop"
    assert as_string == complete(http, max_tokens=16, temperature=0, stop=[stop])


def test_temperature_defaults_to_one(http):
    greedy = complete(http, max_tokens=12, temperature=0)["token_ids"]
    differs = 0
    for seed in SEEDS:
        omitted = complete(http, max_tokens=12, seed=seed)["token_ids"]
        assert omitted == complete(http, max_tokens=12, seed=seed, temperature=1.0)["token_ids"]
        differs += omitted != greedy
    assert differs == len(SEEDS)


def test_top_k_zero_and_minus_one_are_off_and_one_is_greedy(http):
    greedy = complete(http, max_tokens=12, temperature=0)["token_ids"]
    for seed in SEEDS:
        sampled = complete(http, max_tokens=12, temperature=1.4, seed=seed)["token_ids"]
        assert sampled != greedy
        for off in (0, -1):
            assert complete(http, max_tokens=12, temperature=1.4, seed=seed, top_k=off)["token_ids"] == sampled
        assert complete(http, max_tokens=12, temperature=1.4, seed=seed, top_k=1)["token_ids"] == greedy


def test_a_tiny_top_p_keeps_only_the_most_likely_token(http):
    greedy = complete(http, max_tokens=12, temperature=0)["token_ids"]
    for seed in SEEDS:
        assert complete(http, max_tokens=12, temperature=1.4, seed=seed, top_p=1e-6)["token_ids"] == greedy


def test_stop_token_ids_end_the_request_from_min_tokens_on(http):
    greedy = complete(http, max_tokens=12, temperature=0)["token_ids"]
    stop_id = greedy[0]
    first = complete(http, max_tokens=12, temperature=0, stop_token_ids=[stop_id])
    assert first["token_ids"] == [stop_id] and first["finish_reason"] == "stop" and first["text"] == ""
    later = complete(http, max_tokens=12, temperature=0, stop_token_ids=[stop_id], min_tokens=3)
    assert len(later["token_ids"]) >= 3 and stop_id not in later["token_ids"][:3]
    assert later["usage"]["completion_tokens"] == len(later["token_ids"])


def test_completions_generate_16_tokens_unless_told(http):
    assert len(complete(http, temperature=0)["token_ids"]) == 16


def test_max_completion_tokens_wins_over_max_tokens(http):
    response = http.post(CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 9, "max_completion_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    response = http.post(CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 9, "ignore_eos": True})
    assert response.json()["usage"]["completion_tokens"] == 9


def test_logprobs_zero_reports_each_chosen_token_alone(http):
    choice = complete(http, max_tokens=6, temperature=0, logprobs=0)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 6
    assert "".join(logprobs["tokens"]) == choice["text"]
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert top == {token: value} and value <= 0


def test_echo_text_offsets_point_into_the_returned_text(http):
    choice = complete(http, max_tokens=5, temperature=0, logprobs=1, echo=True)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == 3 + 5 and choice["text"].startswith("xyz")
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        assert choice["text"][offset:offset + len(token)] == token
    assert logprobs["text_offset"][3] == 3  # the first generated token starts after the prompt


def test_a_sampled_token_is_among_its_top_logprobs(http):
    """logprobs=1 reports the most likely token, plus the chosen one when sampling chose
    another (as vLLM does): sampling at temperature 3 does, at some positions."""
    beside = 0
    for seed in SEEDS:
        logprobs = complete(http, max_tokens=10, temperature=3.0, seed=seed, logprobs=1)["logprobs"]
        for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
            assert top[token] == pytest.approx(value) and len(top) in (1, 2)
            beside += len(top) == 2
    assert beside > 0


def test_the_model_name_must_match_exactly_or_be_left_out(http):
    for near in (MODEL_NAME[:-1], MODEL_NAME.upper(), MODEL_NAME + "-2"):
        response = http.post(COMPLETIONS, json={"model": near, "prompt": "x", "max_tokens": 1})
        assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    response = http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})
    assert response.status_code == 200 and response.json()["model"] == MODEL_NAME


def test_messages_render_with_the_chat_template_text_parts_joined_by_lines(http, tokenizer):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": None}, {"role": "user", "content": "go on"}]
    response = http.post(CHAT, json={"model": MODEL_NAME, "messages": messages, "max_tokens": 1,
                                     "return_token_ids": True})
    assert response.status_code == 200
    assert tokenizer.chat_template == CHAT_TEMPLATE
    as_strings = [messages[0], {"role": "user", "content": "hi\nthere"}, {"role": "assistant", "content": ""},
                  messages[3]]
    rendered = tokenizer.apply_chat_template(as_strings, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<assistant>") and "None" not in rendered
    assert response.json()["choices"][0]["prompt_token_ids"] == tokenizer.encode(rendered)
    assert response.json()["usage"]["prompt_tokens"] == len(rendered)
