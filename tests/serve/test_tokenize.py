"""vLLM's /tokenize and /detokenize: the ids are those generation runs on (a completion's
prompt, a chat through the template), the count and the context come with them, the text
comes back, and a bad request is a 400 naming its field."""

from __future__ import annotations

import pytest
from in_process import app_client_fixture  # noqa: F401 - fixture
from server_helpers import MODEL_NAME, VOCAB


def test_tokenize_gives_the_ids_generation_runs_on(app_client):
    out = app_client.post("/tokenize", json={"model": MODEL_NAME, "prompt": "xyz"}).json()
    generated = app_client.post("/v1/completions", json={"prompt": "xyz", "max_tokens": 1,
                                                         "return_token_ids": True}).json()
    assert out["tokens"] == generated["choices"][0]["prompt_token_ids"]
    assert out["count"] == len(out["tokens"]) == generated["usage"]["prompt_tokens"] and out["max_model_len"] > 0


def test_tokenize_renders_a_chat_as_the_chat_endpoint_does(app_client):
    messages = [{"role": "user", "content": "hi"}]
    out = app_client.post("/tokenize", json={"messages": messages}).json()
    chat = app_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                         "return_token_ids": True}).json()
    assert out["tokens"] == chat["choices"][0]["prompt_token_ids"]


def test_detokenize_gives_the_text_back(app_client):
    ids = app_client.post("/tokenize", json={"prompt": "hello"}).json()["tokens"]
    assert app_client.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith("hello")


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages[0].role"),
    ("/detokenize", {"tokens": [1, VOCAB]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_requests_are_a_400_naming_the_field(app_client, path, body, param):
    response = app_client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_another_models_name_is_a_404(app_client):
    assert app_client.post("/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404
