"""Bad request bodies from a generator, not a hand list: every field of every request
body (read from the pydantic models themselves, nested ones included) gets hostile values
(wrong types, out-of-range and non-finite numbers, token ids out of the vocabulary or
past 2**32, empty and deeply nested lists, huge strings). Properties: the answer is a
2xx or a 4xx, never a 5xx; a 4xx is in OpenAI's error schema and names the field; an
unknown field is ignored; and the server keeps serving (a valid request right after
succeeds). A new field of a request model is covered without editing this file.

The app runs in-process (FastAPI's TestClient) on the tiny model and character tokenizer
of tests/server_helpers.py, so an example costs milliseconds."""

from __future__ import annotations

import json
import math
import types
import typing
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from in_process import app_client_fixture  # noqa: F401 - fixture
from pydantic import BaseModel
from server_helpers import MODEL_NAME, VOCAB

from kvforge.serve.protocol import ChatCompletionRequest, CompletionRequest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Valid bodies the hostile field is written into; short, so a 200 costs a few steps.
VALID = {COMPLETIONS: {"prompt": "ab", "max_tokens": 2},
         CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
UNKNOWN = "no_such_field_anywhere"
ERROR_KEYS = {"message", "type", "param", "code"}


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (directly, in a union or in a list)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def _is_list_of(annotation: Any, model: type[BaseModel]) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_is_list_of(arg, model) for arg in typing.get_args(annotation))
    return origin is list and model in typing.get_args(annotation)


def field_paths(model: type[BaseModel], prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every field of `model` and of the models nested in it, as paths into a body
    (a list of models is entered at its first item)."""
    paths = []
    for name, info in model.model_fields.items():
        paths.append((*prefix, name))
        for nested in _models_in(info.annotation):
            inner = (*prefix, name, 0) if _is_list_of(info.annotation, nested) else (*prefix, name)
            paths.extend(field_paths(nested, inner))
    return paths


TARGETS = ([(COMPLETIONS, path) for path in field_paths(CompletionRequest)]
           + [(CHAT, path) for path in field_paths(ChatCompletionRequest)]
           + [(COMPLETIONS, (UNKNOWN,)), (CHAT, (UNKNOWN,)), (CHAT, ("messages", 0, UNKNOWN))])

BAD_IDS = [-(2**70), -(2**32), -3, -1, 0, 5, VOCAB - 1, VOCAB, 999_999_999, 2**31, 2**32, 2**63, 2**64, 2**70]
NUMBERS = [0, -1, 1, 2, -(2**63), 2**31, 2**32, 2**63, 2**70, 0.0, -0.0, 0.5, 1.5, -0.5, 1e-300, 5e-324, 1e308,
           -1e308, math.nan, math.inf, -math.inf]
HUGE_STRING = "x" * 100_000
scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(NUMBERS), st.integers(), st.floats(),
                    st.text(max_size=12), st.sampled_from(["", " ", "text", "user", HUGE_STRING]))
token_ids = st.lists(st.sampled_from(BAD_IDS), max_size=4)
hostile = st.recursive(
    st.one_of(scalars, token_ids, st.lists(token_ids, max_size=3), st.just([[[[[[1]]]]]]), st.just([[]])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(["type", "text", "role", "content", "include_usage",
                                                             UNKNOWN]), inner, max_size=3)),
    max_leaves=6)


def with_value(body: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """A deep copy of `body` with `value` at `path` (missing dicts along it created)."""
    body = json.loads(json.dumps(body))
    node: Any = body
    for step, following in zip(path[:-1], path[1:]):
        if isinstance(node, dict) and not isinstance(node.get(step), (dict, list)):
            node[step] = [] if isinstance(following, int) else {}
        if isinstance(node, list) and step >= len(node):
            node.append({} if not isinstance(following, int) else [])
        node = node[step]
    node[path[-1]] = value
    return body


def post(client: TestClient, path: str, body: dict[str, Any]):
    # NaN and infinities are sent as Python's json writes them (a client may): the server
    # must refuse them by field, not fail to parse.
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def check_one(client: TestClient, path: str, field: tuple[str | int, ...], value: Any) -> None:
    body = with_value({"model": MODEL_NAME, **VALID[path]}, field, value)
    response = post(client, path, body)
    shown = f"{json.dumps(body)[:300]} -> {response.status_code} {response.text[:300]}"
    assert response.status_code < 500, shown
    name = str(field[-1])
    if name == UNKNOWN:
        assert response.status_code == 200, shown  # unknown fields are ignored, as OpenAI's SDKs expect
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS, shown
        # A nested field may be refused by a rule on its parent (a huge message content
        # makes the conversation too long: the error names `messages`).
        named = [str(step) for step in field if isinstance(step, str)]
        assert any(part in (error["param"] or "") or part in error["message"] for part in named), shown
        assert len(error["message"]) < 1000, shown
    after = post(client, COMPLETIONS, {"prompt": "ab", "max_tokens": 2, "temperature": 0})
    assert after.status_code == 200, f"after {shown}: {after.text[:300]}"


TARGET_IDS = [f"{'chat' if path == CHAT else 'completions'}:{'.'.join(map(str, field))}" for path, field in TARGETS]


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=hostile)
def test_any_bad_field_is_a_4xx_naming_it_and_the_server_keeps_serving(app_client, target, value):
    check_one(app_client, *target, value)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=hostile)
def test_any_bad_field_many_examples(app_client, target, value):
    check_one(app_client, *target, value)


def test_the_generator_reaches_every_field_and_the_nested_ones():
    paths = {path for _, path in TARGETS}
    for name in CompletionRequest.model_fields:
        assert (name,) in paths
    assert ("messages", 0, "role") in paths and ("messages", 0, "content") in paths
    assert ("stream_options", "include_usage") in paths


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_without_the_json_content_type_is_told_which_header_to_send(app_client, path, content_type):
    """`curl -d '{...}'` sends a form's content type, under which FastAPI leaves the body
    unparsed (as it does with none: its strict content-type rule, a guard against cross-site
    requests, kept): the 400 says which header to send."""
    body = json.dumps({"model": MODEL_NAME, **VALID[path]})
    response = app_client.post(path, content=body, headers={"content-type": content_type} if content_type else {})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "body" and "Content-Type: application/json" in error["message"]
    assert post(app_client, path, json.loads(body)).status_code == 200  # the same body with the header
