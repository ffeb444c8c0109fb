"""vLLM's truncate_prompt_tokens (with truncation_side) and skip_special_tokens: a
truncated prompt generates exactly what its kept tokens sent alone generate, counts as
those in the usage, and is what echo returns; -1 keeps the context less one token; a bad
value is a 400 naming the field. skip_special_tokens=false puts special tokens' text in
the output (a stop token's still not, as vLLM); the default leaves it out.

The app runs in-process on the tiny model and character tokenizer (tests/server_helpers.py:
a context of 512 tokens; <s> = 1, </s> = 2, the EOS)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from in_process import app_client_fixture  # noqa: F401 - fixture
from server_helpers import CONTEXT, MODEL_NAME, char_tokenizer, make_engine, model_fixture, tokenizer_fixture  # noqa: F401

from kvforge.engine.sampling import SamplingParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "the quick brown fox jumps over the lazy dog"


def post(client, path: str, **body: Any):
    body = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "return_token_ids": True, "ignore_eos": True,
            **body}
    # (json.dumps escapes what is not ASCII, so a lone surrogate travels as a client may send it)
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def ok(response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response, param: str) -> None:
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(("side", "keep"), [(None, slice(-10, None)), ("left", slice(-10, None)),
                                            ("right", slice(0, 10))])
def test_a_truncated_prompt_generates_what_its_kept_tokens_generate_alone(app_client, side, keep):
    ids = char_tokenizer().encode(PROMPT)
    cut = ok(post(app_client, COMPLETIONS, prompt=ids, truncate_prompt_tokens=10, truncation_side=side))
    alone = ok(post(app_client, COMPLETIONS, prompt=ids[keep]))
    assert cut["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert cut["choices"][0]["prompt_token_ids"] == ids[keep]
    assert cut["usage"]["prompt_tokens"] == 10


def test_a_prompt_within_the_limit_is_left_whole(app_client):
    ids = char_tokenizer().encode(PROMPT)
    whole = ok(post(app_client, COMPLETIONS, prompt=PROMPT, truncate_prompt_tokens=len(ids)))
    assert whole["usage"]["prompt_tokens"] == len(ids)


def test_echo_returns_the_prompt_the_model_saw(app_client):
    tokenizer = char_tokenizer()
    kept = tokenizer.decode(tokenizer.encode(PROMPT)[-8:])
    body = ok(post(app_client, COMPLETIONS, prompt=PROMPT, truncate_prompt_tokens=8, echo=True))
    assert body["choices"][0]["text"].startswith(kept) and kept.endswith("lazy dog")


def test_minus_one_keeps_the_context_less_one_token(app_client):
    long = "ab" * CONTEXT
    refused(post(app_client, COMPLETIONS, prompt=long, max_tokens=1), "prompt")
    body = ok(post(app_client, COMPLETIONS, prompt=long, truncate_prompt_tokens=-1))  # max_tokens 6: lowered to 1
    assert body["usage"]["prompt_tokens"] == CONTEXT - 1 and body["usage"]["completion_tokens"] == 1


def test_with_truncation_max_tokens_is_lowered_to_the_room_left_as_vllm_does(app_client):
    ids = char_tokenizer().encode(PROMPT)
    body = ok(post(app_client, COMPLETIONS, prompt=ids, max_tokens=CONTEXT, truncate_prompt_tokens=len(ids)))
    assert body["usage"]["completion_tokens"] == CONTEXT - len(ids)
    refused(post(app_client, COMPLETIONS, prompt=ids, max_tokens=CONTEXT), "max_tokens")  # without: a 400


def test_chat_prompts_are_truncated_too(app_client):
    messages = [{"role": "user", "content": PROMPT}]
    whole = ok(post(app_client, CHAT, messages=messages))["choices"][0]["prompt_token_ids"]
    for side, kept in (("left", whole[-12:]), ("right", whole[:12])):
        body = ok(post(app_client, CHAT, messages=messages, truncate_prompt_tokens=12, truncation_side=side))
        assert body["choices"][0]["prompt_token_ids"] == kept and body["usage"]["prompt_tokens"] == 12


@pytest.mark.parametrize(("fields", "param"), [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": CONTEXT + 1}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "8"}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 8, "truncation_side": "middle"}, "truncation_side"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"bad_words": ["\ud800"]}, "bad_words"),  # a lone surrogate: no tokenizer can take it
])
def test_bad_values_are_a_400_naming_the_field(app_client, fields, param):
    refused(post(app_client, COMPLETIONS, prompt=PROMPT, **fields), param)


def test_skip_special_tokens_false_shows_special_tokens_text(app_client):
    forced = {"logit_bias": {"1": 100}}  # <s>, a special token that is not the EOS
    shown = ok(post(app_client, COMPLETIONS, prompt=PROMPT, skip_special_tokens=False, **forced))
    assert shown["choices"][0]["token_ids"] == [1] * 6 and shown["choices"][0]["text"] == "<s>" * 6
    hidden = ok(post(app_client, COMPLETIONS, prompt=PROMPT, **forced))
    assert hidden["choices"][0]["text"] == ""


def test_a_stop_token_text_stays_out_with_special_tokens_shown(model, tokenizer):
    engine = make_engine(model, tokenizer)
    params = SamplingParams.greedy_params(6, skip_special_tokens=False, logit_bias={2: 100})  # </s>, the EOS
    engine.add_request(tokenizer.encode(PROMPT), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].token_ids == [2] and outputs[-1].text == "" and outputs[-1].finish_reason == "stop"


def test_bad_words_never_appear_in_the_output(app_client):
    free = ok(post(app_client, COMPLETIONS, prompt=PROMPT, max_tokens=16))["choices"][0]["text"]
    words = [free[2:4], free[6:9]]
    text = ok(post(app_client, COMPLETIONS, prompt=PROMPT, max_tokens=16, bad_words=words))["choices"][0]["text"]
    assert text != free and not any(word in text for word in words), (free, text, words)


@pytest.mark.parametrize(("fields", "param"), [
    ({"bad_words": [""]}, "bad_words"), ({"bad_words": "ab"}, "bad_words"),
    ({"bad_words": ["ab"], "allowed_token_ids": [5]}, "bad_words"),
    ({"bad_words": ["ab"], "guided_choice": ["x"]}, "bad_words"),
])
def test_bad_words_that_cannot_work_are_a_400(app_client, fields, param):
    refused(post(app_client, COMPLETIONS, prompt=PROMPT, **fields), param)


def test_return_tokens_as_token_ids_names_each_logprob_token_by_id(app_client):
    plain = ok(post(app_client, COMPLETIONS, prompt=PROMPT, logprobs=2))["choices"][0]
    named = ok(post(app_client, COMPLETIONS, prompt=PROMPT, logprobs=2, return_tokens_as_token_ids=True))["choices"][0]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in plain["token_ids"]]
    assert all(key.startswith("token_id:") for top in named["logprobs"]["top_logprobs"] for key in top)
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]  # offsets still count the text
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    chat = ok(post(app_client, CHAT, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2,
                   return_tokens_as_token_ids=True))["choices"][0]
    content = chat["logprobs"]["content"]
    assert [item["token"] for item in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    tokenizer = char_tokenizer()  # bytes still spell each token's own text
    assert [item["bytes"] for item in content] == [list(tokenizer.decode([t]).encode()) for t in chat["token_ids"]]
    assert all(top["token"].startswith("token_id:") for item in content for top in item["top_logprobs"])
    with app_client.stream("POST", CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 4, "stream": True, "logprobs": True, "temperature": 0,
                                               "return_tokens_as_token_ids": True}) as response:
        tokens = [item["token"] for line in response.iter_lines() if line.startswith("data: {")
                  for choice in json.loads(line[6:])["choices"] if choice.get("logprobs")
                  for item in choice["logprobs"]["content"]]
    assert len(tokens) == 4 and all(token.startswith("token_id:") for token in tokens)
