"""A request that fails mid-generation fails its whole response, as in vLLM, and alone: a
non-streamed response is a 500 naming why; a stream, whose 200 went out before its first
event, ends with an error event in OpenAI's error schema followed by `[DONE]` (never a
choice with finish_reason "error", never a cut connection). The request's other choices are aborted, and the server
answers the next request normally.

Three ways to fail are driven for real: a request whose constraint's matcher refuses the
chosen token (the mask is made to allow every id and a bias forces a digit into a
lower-case regex), an engine step that raises, and a bug while writing the events."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from grammar_helpers import byte_model_fixture, byte_tokenizer  # noqa: F401 - fixture
from server_helpers import MODEL_NAME, make_engine
from test_structured_output_api import CHAT, COMPLETIONS
from test_structured_output_api import post as structured_post

from kvforge.engine import llm_engine
from kvforge.engine.async_engine import AsyncEngine, EngineStepError, EngineUnavailableError
from kvforge.engine.llm_engine import LLMEngine
from kvforge.serve import chat as chat_module
from kvforge.serve import logprobs as logprobs_module
from kvforge.serve import streams as streams_module
from kvforge.serve.app import create_app
from kvforge.serve.protocol import APIError
from kvforge.serve.served_model import ServedModel

pytest.importorskip("llguidance")

@pytest.fixture(scope="module")
def served(model) -> Iterator[tuple[TestClient, LLMEngine]]:
    tokenizer = byte_tokenizer()
    engine = make_engine(model, tokenizer)
    app = create_app(ServedModel(MODEL_NAME, AsyncEngine(engine), tokenizer))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, engine


def post(client: TestClient, path: str, **body: Any):
    return structured_post(client, path, **{"max_tokens": 8, "temperature": 0, **body})


def events(response) -> list[Any]:
    """The stream's events, parsed ("[DONE]" kept as the string)."""
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


@pytest.fixture
def breaking_constraint(served, monkeypatch) -> dict[str, Any]:
    """Body fields whose request ends with an error at its first sampled token: the mask
    allows every id and a bias forces "5", which the regex refuses."""
    monkeypatch.setattr(llm_engine, "allowed_masks",
                        lambda matchers, vocab: (torch.ones(len(matchers), vocab, dtype=torch.bool), []))
    digit = byte_tokenizer().convert_tokens_to_ids("5")
    return {"structured_outputs": {"regex": "[a-z]+"}, "logit_bias": {str(digit): 100}}


def assert_serves_normally(client: TestClient, engine: LLMEngine) -> None:
    for path in (COMPLETIONS, CHAT):
        response = post(client, path)
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length", response.text
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("n", [1, 3])
def test_a_request_ending_in_error_is_a_500_naming_why(served, breaking_constraint, path, n):
    client, engine = served
    response = post(client, path, n=n, temperature=1.0, seed=1, **breaking_constraint)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "internal_error", error
    assert "the generation failed" in error["message"] and "structured-output constraint" in error["message"], error
    assert_serves_normally(client, engine)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_streamed_request_ending_in_error_ends_with_an_error_event_and_done(served, breaking_constraint, path):
    client, engine = served
    got = events(post(client, path, stream=True, n=2, **breaking_constraint))
    assert got[-1] == "[DONE]" and "error" in got[-2], got
    assert "structured-output constraint" in got[-2]["error"]["message"], got[-2]
    assert all(choice.get("finish_reason") != "error" for event in got[:-2] for choice in event["choices"]), got
    assert_serves_normally(client, engine)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_an_engine_step_failing_mid_stream_ends_it_with_an_error_event(served, monkeypatch, path):
    """The step fails after the stream has sent tokens: what was sent stays, an error event
    naming the step's failure and [DONE] follow."""
    client, engine = served
    execute, calls = engine.runner.execute, []

    def failing_third_step(items):
        calls.append(len(items))
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return execute(items)

    monkeypatch.setattr(engine.runner, "execute", failing_third_step)
    got = events(post(client, path, stream=True, max_tokens=8, ignore_eos=True))
    assert got[-1] == "[DONE]" and "injected fault" in got[-2]["error"]["message"], got[-2:]
    assert "engine step failed" in got[-2]["error"]["message"]
    sent = "".join(c.get("text", "") or c.get("delta", {}).get("content", "") for e in got[:-2] for c in e["choices"])
    assert sent, got  # tokens of the first two steps reached the client first
    monkeypatch.undo()
    assert_serves_normally(client, engine)


def test_a_non_streamed_engine_step_failure_is_a_500(served, monkeypatch):
    client, engine = served

    def failing(items):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "execute", failing)
    response = post(client, COMPLETIONS)
    assert response.status_code == 500 and "injected fault" in response.json()["error"]["message"], response.text
    monkeypatch.undo()
    assert_serves_normally(client, engine)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_bug_while_writing_events_ends_the_stream_with_an_error_event(served, monkeypatch, path):
    """A failure in the handler's own code (here the logprobs builder raises) is reported in
    the stream, named by its type, and the request is aborted in the engine before the report
    is written (not whenever its stream is collected)."""
    client, engine = served
    happened: list[str] = []

    def broken(self, *args, **kwargs):
        raise ValueError("builder bug")

    def recorded(name: str, original):
        def call(*args, **kwargs):
            happened.append(name)
            return original(*args, **kwargs)
        return call

    monkeypatch.setattr(logprobs_module.CompletionLogprobs, "add", broken)
    monkeypatch.setattr(chat_module, "chat_logprobs", lambda *args: broken(None))
    monkeypatch.setattr(AsyncEngine, "abort", recorded("abort", AsyncEngine.abort))
    monkeypatch.setattr(streams_module, "api_error_of", recorded("report", streams_module.api_error_of))
    logprobs = {"logprobs": 1} if path == COMPLETIONS else {"logprobs": True}
    got = events(post(client, path, stream=True, max_tokens=6, ignore_eos=True, **logprobs))
    assert got[-1] == "[DONE]" and got[-2]["error"]["message"] == "internal error: ValueError: builder bug", got[-2:]
    assert happened == ["abort", "report"], happened
    monkeypatch.undo()
    assert_serves_normally(client, engine)


def test_a_failure_is_reported_alike_streamed_or_not():
    """One mapping for both paths: an engine that stopped is a 503 in a stream as in a
    non-streamed response, a failed step a 500, a refusal keeps its own status."""
    stopped = streams_module.api_error_of(EngineUnavailableError("the engine is shutting down"))
    assert (stopped.status, stopped.error_type, stopped.message) == (503, "service_unavailable",
                                                                     "the engine is shutting down")
    failed = streams_module.api_error_of(EngineStepError("the engine step failed: boom"))
    assert (failed.status, failed.error_type) == (500, "internal_error")
    refusal = APIError(400, "invalid n=0: must be >= 1", param="n")
    assert streams_module.api_error_of(refusal) is refusal
