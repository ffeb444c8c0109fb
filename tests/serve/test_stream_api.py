"""Streaming over HTTP against the same request unstreamed, read as raw server-sent events:
the framing (`data: {...}` events, each ended by a blank line, `data: [DONE]` last), stop
strings that span tokens never reaching a chunk, and, for random requests on both
endpoints, streamed == non-streamed in text, token ids, logprobs, finish reason and usage.

The model is a tiny random Llama with a character tokenizer (tests/server_helpers.py):
every visible character is one token, so a stop string of k characters spans k tokens."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
import torch
from server_helpers import (
    MODEL_NAME,
    make_engine,
    serve,
    tiny_model,
    tokenizer_fixture,  # noqa: F401 - fixtures
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tokenizer):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_model()
    with serve(make_engine(model, tokenizer), tokenizer) as running:
        yield running
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


def events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed request, after checking the SSE framing of the whole body."""
    with http.stream("POST", path, json={"model": MODEL_NAME, **body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("\n\n")
    blocks = raw[:-2].split("\n\n")
    for block in blocks:
        assert block.startswith("data: ") and "\n" not in block, f"not one data line ended by a blank line: {block!r}"
    assert blocks[-1] == "data: [DONE]", "the stream must end with data: [DONE]"
    return [json.loads(block[len("data: "):]) for block in blocks[:-1]]


def completion_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A completions stream (one prompt) put back together as the unstreamed choice."""
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    logprobs = None
    if choices[0]["logprobs"] is not None:
        logprobs = {key: [v for c in choices for v in c["logprobs"][key]]
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    reasons = [c["finish_reason"] for c in choices]
    assert all(r is None for r in reasons[:-1])
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return {"text": "".join(c["text"] for c in choices), "token_ids": [t for c in choices for t in c["token_ids"]],
            "logprobs": logprobs, "finish_reason": reasons[-1], "usage": usage[-1] if usage else None}


def chat_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat stream put back together as the unstreamed choice."""
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    logprobs = None
    if any(c["logprobs"] is not None for c in choices[1:]):
        logprobs = {"content": [entry for c in choices[1:] for entry in c["logprobs"]["content"]]}
    reasons = [c["finish_reason"] for c in choices]
    assert all(r is None for r in reasons[:-1])
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return {"content": "".join(c["delta"].get("content", "") for c in choices),
            "token_ids": [t for c in choices[1:] for t in c["token_ids"]], "logprobs": logprobs,
            "finish_reason": reasons[-1], "usage": usage[-1] if usage else None}


def first_unique(text: str, length: int, start: int = 2) -> int:
    """The first index >= start where text[i:i+length] occurs for the first time."""
    return next(i for i in range(start, len(text) - length) if text.find(text[i:i + length]) == i)


@pytest.mark.parametrize("length", [2, 3])
def test_completion_stop_string_across_tokens_never_reaches_a_chunk(http, length):
    body = {"prompt": "xyz", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    text = post(http, COMPLETIONS, body)["choices"][0]["text"]
    start = first_unique(text, length)
    stop = text[start:start + length]
    whole = post(http, COMPLETIONS, {**body, "stop": [stop]})["choices"][0]
    assert whole["text"] == text[:start] and whole["finish_reason"] == "stop"
    chunks = events(http, COMPLETIONS, {**body, "stop": [stop]})
    streamed = completion_stream(chunks)
    pieces = [c["choices"][0]["text"] for c in chunks]
    assert streamed["text"] == text[:start], f"stop {stop!r}: chunks {pieces}"
    assert streamed["finish_reason"] == "stop" and streamed["token_ids"] == whole["token_ids"]


@pytest.mark.parametrize("length", [2, 3])
def test_chat_stop_string_across_tokens_never_reaches_a_chunk(http, length):
    body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    content = post(http, CHAT, body)["choices"][0]["message"]["content"]
    start = first_unique(content, length)
    stop = content[start:start + length]
    whole = post(http, CHAT, {**body, "stop": stop})["choices"][0]
    assert whole["message"]["content"] == content[:start] and whole["finish_reason"] == "stop"
    chunks = events(http, CHAT, {**body, "stop": stop})
    streamed = chat_stream(chunks)
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert streamed["content"] == content[:start], f"stop {stop!r}: chunks {pieces}"
    assert streamed["finish_reason"] == "stop" and streamed["token_ids"] == whole["token_ids"]


def sampling_fields(rng: random.Random) -> dict[str, Any]:
    """Sampling fields of one random request, greedy or seeded (so it can be repeated)."""
    fields: dict[str, Any] = {"max_tokens": rng.randint(3, 14), "ignore_eos": True, "return_token_ids": True,
                              "stream_options": {"include_usage": True}, "seed": rng.randrange(10_000)}
    if rng.random() < 0.5:
        fields["temperature"] = 0
    else:
        fields.update(temperature=rng.choice([0.6, 1.0, 1.4]), top_p=rng.choice([1.0, 0.8]),
                      top_k=rng.choice([0, -1, 12]))
    return fields


def stop_fields(rng: random.Random, generated: str) -> dict[str, Any]:
    """Mostly a stop string of 1-3 characters cut from `generated` (the text the request
    produces without it), alone or beside one that never completes; sometimes none."""
    if rng.random() < 0.2 or len(generated) < 3:
        return {}
    length = rng.choice([1, 2, 2, 3, 3])
    begin = rng.randrange(1, max(2, len(generated) - length + 1))
    stop = generated[begin:begin + length]
    return {"stop": stop if rng.random() < 0.5 else [stop, stop[::-1] + "\x07"]}


@pytest.mark.parametrize("seed", range(2))
def test_completions_streamed_equal_unstreamed(http, seed):
    rng = random.Random(seed)
    for _ in range(5):
        prompt = "".join(rng.choice("abcdefgh xyz") for _ in range(rng.randint(1, 10)))
        fields = sampling_fields(rng)
        generated = post(http, COMPLETIONS, {"prompt": prompt, **fields})["choices"][0]["text"]
        body = {"prompt": prompt, **fields, **stop_fields(rng, generated)}
        if rng.random() < 0.7:
            body["logprobs"] = rng.randint(0, 3)
            body["echo"] = rng.random() < 0.3
        whole = post(http, COMPLETIONS, body)
        choice = whole["choices"][0]
        streamed = completion_stream(events(http, COMPLETIONS, body))
        assert streamed["text"] == choice["text"], body
        assert streamed["token_ids"] == choice["token_ids"], body
        assert streamed["finish_reason"] == choice["finish_reason"], body
        assert streamed["logprobs"] == choice["logprobs"], body
        assert streamed["usage"] == whole["usage"], body
        assert whole["usage"]["completion_tokens"] == len(choice["token_ids"])
        assert whole["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
        assert whole["usage"]["total_tokens"] == len(choice["prompt_token_ids"]) + len(choice["token_ids"])


@pytest.mark.parametrize("seed", range(2))
def test_chat_streamed_equals_unstreamed(http, seed):
    rng = random.Random(100 + seed)
    for _ in range(5):
        messages = [{"role": "user", "content": "".join(rng.choice("abcdefgh xyz") for _ in range(8))}]
        fields = sampling_fields(rng)
        generated = post(http, CHAT, {"messages": messages, **fields})["choices"][0]["message"]["content"]
        body = {"messages": messages, **fields, **stop_fields(rng, generated)}
        if rng.random() < 0.7:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        whole = post(http, CHAT, body)
        choice = whole["choices"][0]
        streamed = chat_stream(events(http, CHAT, body))
        assert streamed["content"] == choice["message"]["content"], body
        assert streamed["token_ids"] == choice["token_ids"], body
        assert streamed["finish_reason"] == choice["finish_reason"], body
        assert streamed["logprobs"] == choice["logprobs"], body
        assert streamed["usage"] == whole["usage"], body
        assert whole["usage"]["completion_tokens"] == len(choice["token_ids"])
        assert whole["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
