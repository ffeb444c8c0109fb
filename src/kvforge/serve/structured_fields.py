"""The request fields that constrain a completion's text, read into the engine's one
`StructuredOutputs`:

- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}` (any
  JSON object), `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`;
- vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object":
  ..., "disable_any_whitespace": bool}`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of them may set a constraint (vLLM lets `response_format` override the others
silently; a 400 says it instead). Errors name the field the client sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvforge.engine.structured_output import StructuredOutputs, constraint_fields
from kvforge.errors import ConfigError
from kvforge.serve.protocol import _GenerationFields, bad_request

T = TypeVar("T")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_of(body: _GenerationFields, from_tools: StructuredOutputs | None = None) -> StructuredOutputs | None:
    """The constraint the body asks for, or None; a 400 naming the field when it is malformed.
    `from_tools`: a chat's tool choice's own constraint (serve/tool_calls.py), one more
    source that may not be combined with the others."""
    found: list[tuple[str, dict[str, Any] | None]] = []
    response_format = _from_response_format(body.response_format)
    if response_format is not None:
        found.append(("response_format", response_format))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _checked(constraint_fields, body.structured_outputs, "structured_outputs")))
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, {kind: value}))
    if from_tools is not None:
        found.append(("tool_choice", None))
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise bad_request(names[1], "...", f"cannot be combined with {names[0]}: one constraint per request")
    origin, fields = found[0]
    if fields is None:
        return from_tools
    return _checked(lambda: StructuredOutputs(**fields, origin=origin))


def _checked(make: Callable[..., T], *args: Any) -> T:
    """`make(*args)`, its ConfigError a 400 naming the same field."""
    try:
        return make(*args)
    except ConfigError as exc:
        raise bad_request(exc.parameter, exc.value, exc.rule) from exc


def _from_response_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if not value:
        return None
    kind = value.get("type")
    if kind is None:
        raise bad_request("response_format", value, "needs a type: text, json_object or json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request("response_format", value, "type json_schema needs json_schema.schema, a JSON schema "
                                                        "object")
        return {"json": spec["schema"]}
    raise bad_request("response_format", value, "type must be text, json_object or json_schema")
