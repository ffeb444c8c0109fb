"""OpenAI's function calling for the choices that need no model-specific parser: a named
function gives one call whose arguments are JSON of its parameters' schema ("stop"),
"required" gives one or more calls of the listed functions ("tool_calls"; one with
parallel_tool_calls false), streamed or not; "none" only shows the tools to the template;
"auto" and malformed tools are a 400 naming the field. The model is a tiny random Llama
over a byte-fallback tokenizer (tests/grammar_helpers.py): only the constraint shapes it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from grammar_helpers import byte_client_fixture, byte_model_fixture, byte_tokenizer  # noqa: F401 - fixtures
from server_helpers import MODEL_NAME, make_engine, serve

from kvforge.models.tokenizer import encode_prompt

pytest.importorskip("llguidance")

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"enum": ["paris", "oslo"]},
                                                                          "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
                                                           "required": ["city", "days"],
                                                           "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "weather"}}


def post(client: TestClient, **body: Any):
    return client.post(CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 120, "temperature": 1.0, "seed": 5, **body})


def ok(response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def check_arguments(name: str, arguments: str) -> None:
    value = json.loads(arguments)
    if name == "weather":
        assert value["city"] in ("paris", "oslo") and 1 <= value["days"] <= 7 and set(value) == {"city", "days"}
    else:
        assert value == {"zone": value["zone"]} and value["zone"] in ("utc", "cet")


def test_a_named_function_gives_one_call_of_it(client):
    body = ok(post(client, tools=[WEATHER, CLOCK], tool_choice=NAMED, n=3))
    for choice in body["choices"]:
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert call["function"]["name"] == "weather" and choice["message"]["content"] == ""
        check_arguments("weather", call["function"]["arguments"])
        assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("parallel", [None, False])
def test_required_gives_calls_of_the_listed_functions(client, parallel):
    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    body = ok(post(client, tools=[WEATHER, CLOCK], tool_choice="required", n=4, max_tokens=200, **fields))
    finished = [c for c in body["choices"] if c["finish_reason"] == "tool_calls"]
    assert finished
    for choice in finished:
        calls = choice["message"]["tool_calls"]
        assert calls and (parallel is None or len(calls) == 1)
        assert len({call["id"] for call in calls}) == len(calls)
        for call in calls:
            check_arguments(call["function"]["name"], call["function"]["arguments"])


def events(client: TestClient, **body: Any) -> list[dict[str, Any]]:
    with client.stream("POST", CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 120, "temperature": 1.0, "seed": 5, "stream": True,
                                           **body}) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: {")]


def test_a_streamed_named_call_streams_its_arguments(client):
    whole = ok(post(client, tools=[WEATHER], tool_choice=NAMED))["choices"][0]
    chunks = [c["choices"][0] for c in events(client, tools=[WEATHER], tool_choice=NAMED)]
    pieces = [d["delta"]["tool_calls"][0] for d in chunks if d["delta"].get("tool_calls")]
    assert pieces[0]["id"].startswith("chatcmpl-tool-") and pieces[0]["function"]["name"] == "weather"
    assert all("id" not in p and "name" not in p["function"] for p in pieces[1:])
    arguments = "".join(p["function"]["arguments"] for p in pieces)
    assert arguments == whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert not any(d["delta"].get("content") for d in chunks) and chunks[-1]["finish_reason"] == "stop"


def joined_calls(pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stream's tool-call pieces joined per call, as a client does: the id and name from
    the call's first piece (and only there), the arguments from all of them in order."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if piece["index"] not in calls:
            assert piece["id"].startswith("chatcmpl-tool-") and piece["function"]["name"], piece
            calls[piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
        else:
            assert "id" not in piece and "name" not in piece["function"], piece
        calls[piece["index"]]["arguments"] += piece["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))  # opened in order
    return [calls[index] for index in sorted(calls)]


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_a_streamed_required_reply_streams_each_call_as_it_grows(client, seed):
    """The calls arrive piece by piece, and join to the calls of the same reply unstreamed
    (the same seed draws the same tokens)."""
    fields = {"tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 300, "seed": seed}
    whole = ok(post(client, **fields))["choices"][0]
    assert whole["finish_reason"] == "tool_calls", whole
    chunks = [c["choices"][0] for c in events(client, **fields)]
    with_calls = [d for d in chunks if d["delta"].get("tool_calls")]
    assert len(with_calls) > len(whole["message"]["tool_calls"])  # streamed, not sent whole at the end
    calls = joined_calls([piece for d in with_calls for piece in d["delta"]["tool_calls"]])
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    for call in calls:
        check_arguments(call["name"], call["arguments"])
    assert chunks[-1]["finish_reason"] == "tool_calls" and not any(d["delta"].get("content") for d in chunks)


def test_a_required_reply_cut_before_a_call_opens_streams_its_text_as_content(client):
    """Cut by max_tokens before any call's name is closed: no call, the text as content, as
    unstreamed; finish_reason stays "length"."""
    fields = {"tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 3}
    whole = ok(post(client, **fields))["choices"][0]
    assert whole["finish_reason"] == "length" and "tool_calls" not in whole["message"]
    chunks = [c["choices"][0] for c in events(client, **fields)]
    assert not any(d["delta"].get("tool_calls") for d in chunks)
    assert "".join(d["delta"].get("content", "") for d in chunks) == whole["message"]["content"] != ""
    assert chunks[-1]["finish_reason"] == "length"


def test_none_shows_the_tools_to_the_template_and_constrains_nothing(client):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = ("{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
                               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    shown = encode_prompt(tokenizer, [{"role": "user", "content": "hi"}], chat=True, tools=[WEATHER, CLOCK])
    assert tokenizer.decode(shown) == "[weather;clock;]hi"
    choice = ok(post(client, tools=[WEATHER], tool_choice="none", max_tokens=8))["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] in ("stop", "length")


def test_earlier_calls_and_tool_answers_in_the_history_are_accepted(client):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                                      "arguments": '{"city": "oslo", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    ok(post(client, messages=messages, tools=[WEATHER], tool_choice=NAMED))


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tools": [WEATHER]}, "tool_choice", "parser"),  # "auto", the default with tools
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "parser"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "one of the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]", "must be"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"},
     "tools[0].function.name", "non-empty"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "once"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "required"},
     "tools[0].function.parameters", "schema"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice",
     "one constraint"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 3,
                                                                                "maximum": 1}}}],
      "tool_choice": "required"}, "tools", "compile"),
])
def test_bad_tools_or_choices_are_a_400_naming_the_field(client, fields, param, words):
    response = post(client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_official_client_reads_the_call(model):
    openai = pytest.importorskip("openai")
    tokenizer = byte_tokenizer()
    with serve(make_engine(model, tokenizer), tokenizer) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               tools=[WEATHER], tool_choice=NAMED, max_tokens=120, seed=2)
        (call,) = reply.choices[0].message.tool_calls
        check_arguments(call.function.name, call.function.arguments)
        stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=300,
                                                seed=3, stream=True)
        pieces = [c.model_dump(exclude_none=True) for chunk in stream for c in (chunk.choices[0].delta.tool_calls or [])]
    calls = joined_calls(pieces)
    assert calls and all(c["name"] in ("weather", "clock") for c in calls)
    for call in calls:
        check_arguments(call["name"], call["arguments"])


def test_the_template_gets_each_messages_calls_answers_and_names():
    from kvforge.serve.chat import _messages
    from kvforge.serve.protocol import ChatMessage

    calls = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]
    rendered = _messages([ChatMessage(role="assistant", content=None, tool_calls=calls),
                          ChatMessage(role="tool", content="rain", tool_call_id="call_1", name="weather"),
                          ChatMessage(role="user", content="thanks")])
    assert rendered == [{"role": "assistant", "content": "", "tool_calls": calls},
                        {"role": "tool", "content": "rain", "name": "weather", "tool_call_id": "call_1"},
                        {"role": "user", "content": "thanks"}]
