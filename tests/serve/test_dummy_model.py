"""A server of a model without a tokenizer (`--load-format dummy`: a published shape with
random weights, measured for speed): token-id prompts in, token ids out; whatever needs
text is a 400 naming its field, and the model card says the weights are random."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from server_helpers import MODEL_NAME, make_engine, tiny_model

from kvforge.engine.async_engine import AsyncEngine
from kvforge.serve.app import create_app
from kvforge.serve.served_model import ModelInfo, ServedModel

WEIGHTS = "dummy (random, seed 0)"


@pytest.fixture(scope="module", name="client")
def client_fixture() -> Iterator[TestClient]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    info = ModelInfo(MODEL_NAME, weights=WEIGHTS)
    app = create_app(ServedModel(MODEL_NAME, AsyncEngine(make_engine(tiny_model(), None)), None, info))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
    torch.set_num_threads(threads)


def _complete(client: TestClient, **body) -> dict:
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_token_ids_in_token_ids_out(client):
    out = _complete(client, prompt=[5, 6, 7], return_token_ids=True, ignore_eos=True)
    (choice,) = out["choices"]
    assert choice["text"] == "" and len(choice["token_ids"]) == 4 and choice["prompt_token_ids"] == [5, 6, 7]
    assert out["usage"]["completion_tokens"] == 4


def test_a_stream_sends_one_chunk_per_token_and_the_usage(client):
    body = {"model": MODEL_NAME, "prompt": [[5, 6], [7]], "max_tokens": 3, "min_tokens": 3, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    chunks = [e for e in events if e["choices"]]
    assert len(chunks) == 6 and all(len(e["choices"][0]["token_ids"]) == 1 for e in chunks)
    assert events[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hello"}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [5, 6], "stop": ["x"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
])
def test_what_needs_text_is_refused_naming_the_field(client, path, body, param):
    response = client.post(path, json={"model": MODEL_NAME, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "tokenizer" in error["message"]
    _complete(client, prompt=[5])  # and the server keeps serving


def test_the_model_card_says_the_weights_are_random(client):
    (entry,) = client.get("/v1/models").json()["data"]
    assert entry["kvforge"]["weights"] == WEIGHTS
    assert "token ids only" in ModelInfo(MODEL_NAME, weights=WEIGHTS).banner()
    assert "weights" not in ModelInfo(MODEL_NAME).banner()
