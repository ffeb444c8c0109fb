"""OpenAI's `n`: n completions per prompt, each its own engine request. Choice i of a
prompt is what a request with seed + i alone gives (vLLM's parallel sampling), choices of
a batch are numbered prompt x n + i, streams carry every index, and the usage counts each
prompt once and every completion."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from in_process import app_client_fixture  # noqa: F401 - fixture
from server_helpers import MODEL_NAME

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SAMPLED = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
MESSAGES = [{"role": "user", "content": "abc"}]


def post(client: TestClient, path: str, **body: Any) -> dict[str, Any]:
    response = client.post(path, content=json.dumps({"model": MODEL_NAME, **body}),
                           headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    return response.json()


def chunks(client: TestClient, path: str, **body: Any) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={"model": MODEL_NAME, **body, "stream": True}) as response:
        assert response.status_code == 200
        raw = response.read().decode()
    blocks = [block for block in raw.split("\n\n") if block]
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(block[len("data: "):]) for block in blocks[:-1]]


def test_each_completion_of_n_is_the_single_request_with_its_seed(app_client):
    many = post(app_client, COMPLETIONS, prompt="xyz", n=3, seed=11, **SAMPLED)
    assert [choice["index"] for choice in many["choices"]] == [0, 1, 2]
    alone = [post(app_client, COMPLETIONS, prompt="xyz", seed=11 + i, **SAMPLED)["choices"][0] for i in range(3)]
    assert [c["token_ids"] for c in many["choices"]] == [c["token_ids"] for c in alone]
    assert len({tuple(c["token_ids"]) for c in alone}) > 1  # the seeds give different samples
    prompt_tokens = len(alone[0]["prompt_token_ids"])
    assert many["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3 * 8,
                             "total_tokens": prompt_tokens + 24}


def test_a_batch_of_prompts_numbers_its_choices_prompt_by_n_plus_sample(app_client):
    out = post(app_client, COMPLETIONS, prompt=["ab", "xyz"], n=2, seed=3, **SAMPLED)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in out["choices"]][1:3] == [
        out["choices"][0]["prompt_token_ids"], out["choices"][3]["prompt_token_ids"]]
    second = post(app_client, COMPLETIONS, prompt="xyz", n=2, seed=3, **SAMPLED)["choices"]
    assert [c["token_ids"] for c in out["choices"][2:]] == [c["token_ids"] for c in second]
    prompts = len(out["choices"][0]["prompt_token_ids"]) + len(out["choices"][3]["prompt_token_ids"])
    assert out["usage"]["prompt_tokens"] == prompts and out["usage"]["completion_tokens"] == 4 * 8


def test_completion_streams_carry_every_choice(app_client):
    whole = post(app_client, COMPLETIONS, prompt="xyz", n=2, seed=7, **SAMPLED)
    streamed = chunks(app_client, COMPLETIONS, prompt="xyz", n=2, seed=7, stream_options={"include_usage": True},
                      **SAMPLED)
    by_index: dict[int, list[int]] = {0: [], 1: []}
    for chunk in streamed[:-1]:
        (choice,) = chunk["choices"]
        by_index[choice["index"]] += choice["token_ids"]
    assert [by_index[0], by_index[1]] == [c["token_ids"] for c in whole["choices"]]
    assert streamed[-1]["usage"] == whole["usage"]


def test_chat_gives_n_choices_and_counts_the_prompt_once(app_client):
    many = post(app_client, CHAT, messages=MESSAGES, n=2, seed=5, **SAMPLED)
    alone = [post(app_client, CHAT, messages=MESSAGES, seed=5 + i, **SAMPLED) for i in range(2)]
    assert [c["index"] for c in many["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in many["choices"]] == [a["choices"][0]["message"]["content"]
                                                                    for a in alone]
    assert many["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert many["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    greedy = post(app_client, CHAT, messages=MESSAGES, n=2, temperature=0, max_tokens=6)
    assert greedy["choices"][0]["message"] == greedy["choices"][1]["message"]


def test_chat_streams_open_each_choice_with_the_role_and_carry_its_text(app_client):
    whole = post(app_client, CHAT, messages=MESSAGES, n=2, seed=9, **SAMPLED)
    streamed = chunks(app_client, CHAT, messages=MESSAGES, n=2, seed=9, stream_options={"include_usage": True},
                      **SAMPLED)
    texts = {0: "", 1: ""}
    opened = []
    for chunk in streamed[:-1]:
        (choice,) = chunk["choices"]
        if choice["delta"].get("role") == "assistant":
            assert texts[choice["index"]] == ""  # the role comes before any text of its choice
            opened.append(choice["index"])
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert sorted(opened) == [0, 1]
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert streamed[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("path, body, param, words", [
    (COMPLETIONS, {"n": 0}, "n", "[1, 64]"), (CHAT, {"n": 65}, "n", "[1, 64]"),
    (COMPLETIONS, {"n": 2, "best_of": 3}, "best_of", "n (2)"), (CHAT, {"best_of": 2}, "best_of", "n (1)"),
])
def test_bad_n_and_best_of_are_a_400_naming_them(app_client, path, body, param, words):
    base = {"prompt": "xyz"} if path == COMPLETIONS else {"messages": MESSAGES}
    response = app_client.post(path, json={"model": MODEL_NAME, "max_tokens": 2, **base, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_batch_times_n_is_bounded_and_one_id_spelled_twice_is_refused(app_client):
    response = app_client.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": ["ab"] * 17, "n": 64, "max_tokens": 1})
    assert response.status_code == 400 and "1024" in response.json()["error"]["message"], response.text
    response = app_client.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "ab", "max_tokens": 1,
                                                  "logit_bias": {"7": 1, "07": -1}})
    assert response.status_code == 400 and "twice" in response.json()["error"]["message"], response.text


def test_each_of_n_echoes_the_prompt(app_client):
    out = post(app_client, COMPLETIONS, prompt="xyz", n=2, echo=True, logprobs=1, max_tokens=0)
    assert [c["text"] for c in out["choices"]] == ["xyz", "xyz"]
    assert out["choices"][0]["logprobs"] == out["choices"][1]["logprobs"]


def test_best_of_equal_to_n_is_accepted(app_client):
    out = post(app_client, COMPLETIONS, prompt="xyz", n=2, best_of=2, max_tokens=2)
    assert len(out["choices"]) == 2
