"""Structured output over HTTP: OpenAI's response_format (json_object, json_schema),
vLLM's structured_outputs and its older guided_* fields give text of that shape on both
endpoints, streamed or not, through the official client too; a malformed or uncompilable
constraint, two constraints at once, or a tokenizer llguidance cannot read is a 400 naming
the field the client sent, and the server goes on.

The model is a tiny random Llama over a byte-fallback tokenizer (tests/grammar_helpers.py)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import threading
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from grammar_helpers import byte_client_fixture, byte_model_fixture, byte_tokenizer  # noqa: F401 - fixtures
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import MODEL_NAME, char_tokenizer, make_engine, serve, tiny_model
from test_bad_bodies import hostile

from kvforge.engine.async_engine import AsyncEngine
from kvforge.serve.app import create_app
from kvforge.serve.served_model import ServedModel

pytest.importorskip("llguidance")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def post(client: TestClient, path: str, **body: Any):
    base = {"prompt": "hello"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    body = {"model": MODEL_NAME, "max_tokens": 80, "temperature": 1.2, **base, **body}
    # (json.dumps escapes what is not ASCII, so a lone surrogate travels as a client may send it)
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def texts(response) -> list[str]:
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert all(c["finish_reason"] == "stop" for c in choices), choices
    return [c["text"] if "text" in c else c["message"]["content"] for c in choices]


def refused(response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_response_format_json_schema_gives_json_of_the_schema(client, path):
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}},
            "n": 4, "seed": 7}
    for text in texts(post(client, path, **body)):
        value = json.loads(text)
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 9 and isinstance(value["ok"], bool), text


def test_response_format_json_object_gives_an_object(client):
    body = {"response_format": {"type": "json_object"}, "structured_outputs": None, "n": 3, "seed": 1,
            "max_tokens": 200}
    response = post(client, CHAT, **body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize(("fields", "check"), [
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"regex": "[a-f]{4}[0-9]"}}, lambda t: re.fullmatch("[a-f]{4}[0-9]", t)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     lambda t: " " not in t and set(json.loads(t)) == {"n", "ok"}),
    ({"structured_outputs": {"grammar": 'start: "x" num\nnum: /[0-9]{2}/'}}, lambda t: re.fullmatch("x[0-9]{2}", t)),
    ({"structured_outputs": {"grammar": 'root ::= "y" [0-9] [0-9]'}}, lambda t: re.fullmatch("y[0-9]{2}", t)),  # GBNF
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: set(json.loads(t)) == {"n", "ok"}),
    ({"guided_grammar": 'start: "z"'}, lambda t: t == "z"),
])
def test_vllm_fields_constrain_the_text(client, fields, check):
    for text in texts(post(client, COMPLETIONS, n=3, seed=11, **fields)):
        assert check(text), (fields, text)


def test_a_streamed_constrained_completion_joins_to_the_constrained_text(client):
    with client.stream("POST", COMPLETIONS, json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 80,
                                                  "stream": True, "seed": 3, "temperature": 1.0,
                                                  "response_format": {"type": "json_schema",
                                                                      "json_schema": {"name": "r", "schema": SCHEMA}}}) as response:
        assert response.status_code == 200
        pieces = []
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert set(json.loads("".join(pieces))) == {"n", "ok"}


def test_logprobs_of_a_constrained_reply_are_over_the_ids_the_shape_allows(client):
    """As vLLM reports them: at each position the alternatives are allowed ids only, so
    with more asked than the shape allows they are all of them, and their probabilities sum
    to 1 (the raw distribution spreads over 320 ids)."""
    response = post(client, CHAT, structured_outputs={"choice": ["yes", "no"]}, logprobs=True, top_logprobs=20)
    assert texts(response)[0] in ("yes", "no")
    content = response.json()["choices"][0]["logprobs"]["content"]
    for position in content:
        top = position["top_logprobs"]
        assert 1 <= len(top) < 20 and position["token"] in [alternative["token"] for alternative in top], position
        assert sum(math.exp(alternative["logprob"]) for alternative in top) == pytest.approx(1.0, abs=1e-4), top


@pytest.mark.parametrize(("fields", "param"), [
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "schema": {}}}, "structured_outputs.schema"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "no"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 3, "maximum": 1}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ({"guided_regex": "a", "allowed_token_ids": [5]}, "allowed_token_ids"),
    ({"guided_regex": "\ud800"}, "guided_regex"),  # a lone surrogate: not text llguidance can take
    ({"guided_json": {"const": "\ud800"}}, "guided_json"),
    ({"guided_choice": ["a", "\udfff"]}, "guided_choice"),
    ({"response_format": {"json_schema": {"name": "x", "schema": {}}}}, "response_format"),  # no type
])
def test_a_bad_constraint_is_a_400_naming_the_field_and_the_server_goes_on(client, fields, param):
    refused(post(client, COMPLETIONS, **fields), param)
    assert texts(post(client, COMPLETIONS, guided_choice=["fine"])) == ["fine"]


def test_a_tokenizer_llguidance_cannot_read_is_a_400_and_is_tried_once(monkeypatch):
    """The character tokenizer of the other server tests has a decoder llguidance cannot read."""
    tokenizer = char_tokenizer()
    engine = make_engine(tiny_model(), tokenizer)
    app = create_app(ServedModel(MODEL_NAME, AsyncEngine(engine), tokenizer))
    with TestClient(app, raise_server_exceptions=False) as client:
        message = refused(post(client, COMPLETIONS, guided_regex="[0-9]+"), "guided_regex")
        assert "llguidance cannot read" in message
        monkeypatch.setattr(engine.grammars, "_wrap", lambda: pytest.fail("the failed wrapping was tried again"))
        assert "llguidance cannot read" in refused(post(client, CHAT, guided_choice=["a"]), "guided_choice")


def test_the_server_answers_others_while_a_constraint_waits_for_the_tokenizer(model):
    """The first constrained request waits for llguidance's wrapping of the tokenizer (up to
    seconds); it waits off the event loop, so other requests are answered meanwhile."""
    tokenizer = byte_tokenizer()
    engine = make_engine(model, tokenizer)
    release = threading.Event()
    real = engine.grammars._wrap
    engine.grammars._wrap = lambda: release.wait(30) and real()
    with serve(engine, tokenizer) as server, httpx.Client(base_url=server.base_url, timeout=30) as client:
        waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
            client.post, COMPLETIONS, json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 8,
                                            "guided_choice": ["yes", "no"]})
        try:
            answered = client.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                                   timeout=10)
            assert answered.status_code == 200 and not waiting.done()
        finally:
            release.set()
        assert waiting.result().json()["choices"][0]["text"] in ("yes", "no")


def test_the_official_client_parses_a_json_schema_reply(model):
    openai = pytest.importorskip("openai")
    tokenizer = byte_tokenizer()
    with serve(make_engine(model, tokenizer), tokenizer) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=80, seed=5,
            response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}},
            extra_body={"temperature": 1.1})
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"n", "ok"} and reply.choices[0].finish_reason == "stop"


FIELDS = ["response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]
SHAPED = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object", "text", "x"]),
                           "json_schema": st.fixed_dictionaries({"schema": hostile})}),
    st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                                     "structural_tag"]), hostile, max_size=2),
    st.sampled_from(["(", "[0-9]{1000000}", "a{2,1}", "(?<n>a)", "\\p{Nope}", "root ::= root", "start: start",
                     'start: "', '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}', "x" * 100_000]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=st.one_of(hostile, SHAPED))
def test_hostile_constraints_are_a_4xx_or_honoured_never_a_5xx(client, field, value):
    response = client.post(COMPLETIONS, content=json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4,
                                                            field: value}),
                           headers={"content-type": "application/json"})
    assert response.status_code < 500 or response.status_code == 503, response.text
    if response.status_code >= 400:
        assert re.split(r"[.\[]", response.json()["error"]["param"])[0] in FIELDS, response.text
