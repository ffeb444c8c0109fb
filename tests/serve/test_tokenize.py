"""vLLM's /tokenize and /detokenize: the ids are those generation runs on (a completion's
prompt, a chat through the template), the count and the context come with them, the text
comes back, and a bad request is a 400 naming its field."""

from __future__ import annotations

import pytest
from in_process import app_client_fixture  # noqa: F401 - fixture
from server_helpers import MODEL_NAME, VOCAB, char_tokenizer

CHAR_TOKENIZER = char_tokenizer()


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


def test_vllms_tokenize_options_are_honoured_or_refused_by_name(app_client):
    plain = app_client.post("/tokenize", json={"prompt": "hi"}).json()["tokens"]
    bare = app_client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["tokens"]
    assert bare == [int(t) for t in CHAR_TOKENIZER.encode("hi", add_special_tokens=False)]
    assert plain == [int(t) for t in CHAR_TOKENIZER.encode("hi")]
    named = app_client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
    assert named["token_strs"] == CHAR_TOKENIZER.convert_ids_to_tokens(named["tokens"])
    for body, param in (({"add_generation_prompt": False}, "add_generation_prompt"),
                        ({"chat_template": "{{ x }}"}, "chat_template"), ({"add_special_tokens": True}, "add_special_tokens")):
        response = app_client.post("/tokenize", json={"messages": [{"role": "user", "content": "b"}], **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    neutral = app_client.post("/tokenize", json={"messages": [{"role": "user", "content": "b"}],
                                                 "add_generation_prompt": True, "add_special_tokens": False})
    assert neutral.status_code == 200


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


class _BosTokenizer:
    """Adds a BOS id (1) unless told not to, as Gemma's tokenizer does."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def convert_ids_to_tokens(self, ids):
        return [f"<{i}>" for i in ids]


def test_add_special_tokens_decides_the_bos_of_a_prompt():
    from types import SimpleNamespace

    from kvforge.serve.protocol import TokenizeRequest
    from kvforge.serve.tokenize import TokenizeHandler

    tokenizer = _BosTokenizer()
    served = SimpleNamespace(check_name=lambda name: None, require_tokenizer=lambda param, value: tokenizer,
                             tokenizer=tokenizer, max_model_len=99)
    handler = TokenizeHandler(served, chat=None)
    assert handler.tokenize(TokenizeRequest(prompt="ab"))["tokens"] == [1, 97, 98]
    assert handler.tokenize(TokenizeRequest(prompt="ab", add_special_tokens=True))["tokens"] == [1, 97, 98]
    assert handler.tokenize(TokenizeRequest(prompt="ab", add_special_tokens=False))["tokens"] == [97, 98]
    named = handler.tokenize(TokenizeRequest(prompt="a", return_token_strs=True))
    assert named == {"count": 2, "max_model_len": 99, "tokens": [1, 97], "token_strs": ["<1>", "<97>"]}
