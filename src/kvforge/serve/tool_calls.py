"""OpenAI's function calling, for the tool choices that need no model-specific parser.

`tool_choice: {"type": "function", "function": {"name": F}}` (a named function) constrains
the reply to JSON of F's `parameters` schema, and `"required"` to a JSON array of one or
more `{"name": ..., "parameters": {...}}` calls of the listed functions (at most one with
`parallel_tool_calls: false`), by structured output (engine/structured_output.py), as vLLM
does for these two choices (a call holds its name and parameters and nothing else, which
vLLM's schema leaves open). The reply then carries `tool_calls` (arguments as the JSON
text the model wrote) and empty content; `finish_reason` is "tool_calls" for "required" and "stop" for a named
function, as OpenAI's API answers. `"none"` shows the tools to the chat template and
constrains nothing. `"auto"`, the default once tools are sent, needs a parser of each
model family's own tool-call syntax (vLLM's `--tool-call-parser`), which kvforge lacks:
a 400 says so.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kvforge.engine.structured_output import StructuredOutputs
from kvforge.serve.call_array import CallArrayReader, CallSpan, scan_calls
from kvforge.serve.protocol import bad_request


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of generation."""

    tools: list[dict[str, Any]]  # as the chat template takes them
    mode: str  # "none", "named" or "required"
    name: str | None = None  # the named function
    constraint: StructuredOutputs | None = None

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool calls of a finished reply, arguments as the model wrote them. A named
        function's arguments are the text whole, cut or not (as vLLM); a "required" reply that
        is not complete (cut by max_tokens or a stop string) gives None: its text is
        returned as content."""
        if self.mode == "named":
            return [_call(self.name or "", text)]
        if not self.complete(text):
            return None
        return [_call(span.name or "", text[span.arguments_start:span.arguments_end]) for span in scan_calls(text)]

    def complete(self, text: str) -> bool:
        """Whether a finished reply holds its calls whole: always for a named function; for
        "required", a closed array of one or more calls, each with its name and parameters."""
        if self.mode == "named":
            return True
        if self.mode != "required":
            return False
        try:
            json.loads(text)
        except ValueError:
            return False
        spans = scan_calls(text)
        return bool(spans) and all(s.name is not None and s.arguments_end is not None for s in spans)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.mode == "required" and reason == "stop" else reason


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
              parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The plan of a request's tools, or None without tools; a 400 naming the field when the
    tools or the choice are malformed or ask for what kvforge cannot do."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice", tool_choice, "needs tools")
        return None
    functions = [_function(index, tool) for index, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise bad_request("tools", names, "must name each function once")
    if tool_choice == "none":
        return ToolPlan(tools, "none")
    if tool_choice in (None, "auto"):
        raise bad_request("tool_choice", tool_choice or "auto (the default with tools)",
                          "needs a parser of the model's own tool-call syntax, which kvforge lacks: send "
                          "'required', a named function ({'type': 'function', 'function': {'name': ...}}), or 'none'")
    if tool_choice == "required":
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": _parameters(f)},
             "required": ["name", "parameters"], "additionalProperties": False} for f in functions]}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(tools, "required", constraint=_constraint(schema))
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise bad_request("tool_choice", tool_choice, f"must name one of the tools' functions {names}")
        return ToolPlan(tools, "named", name, _constraint(_parameters(chosen[0])))
    raise bad_request("tool_choice", tool_choice, "must be 'none', 'required', 'auto' or "
                                                  "{'type': 'function', 'function': {'name': ...}}")


def _function(index: int, tool: Any) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise bad_request(f"tools[{index}]", tool, "must be {'type': 'function', 'function': {'name': ..., ...}}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise bad_request(f"tools[{index}].function.name", function.get("name"), "must be a non-empty string")
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise bad_request(f"tools[{index}].function.parameters", function["parameters"],
                          "must be a JSON schema object")
    return function


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object"}


def _constraint(schema: dict[str, Any]) -> StructuredOutputs:
    return StructuredOutputs(json=schema, origin="tools")


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCallDeltas:
    """One streamed choice's deltas under a plan that constrains (named or "required"). Each
    call's first delta carries its id and name, the next ones the arguments as they come,
    so the pieces join to the finished reply's arguments. A named function's arguments are
    the text itself; a "required" reply is read as it grows (call_array.py, each character
    once): a call opens once its name is closed. A "required" reply that ends before any call opened (cut) ends
    with its text as content, as when it is not streamed."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.call_ids: list[str] = []  # of the calls opened so far
        self.sent: list[int] = []  # characters of each opened call's arguments sent so far
        self.reader = CallArrayReader()

    def delta(self, new_text: str, finished: bool, text: str) -> dict[str, Any]:
        if self.plan.mode == "named":
            spans = [CallSpan(self.plan.name, 0, None)] if text else []
        else:
            spans = self.reader.read(text)
        pieces = []
        for index, span in enumerate(spans):
            if span.name is None:
                break  # (calls open in order)
            piece: dict[str, Any] = {"index": index, "function": {}}
            if index == len(self.call_ids):
                self.call_ids.append(_call_id())
                self.sent.append(0)
                piece.update(id=self.call_ids[index], type="function")
                piece["function"]["name"] = span.name
            if span.arguments_start is not None:
                end = len(text) if span.arguments_end is None else span.arguments_end
                arguments = text[span.arguments_start + self.sent[index]:end]
                self.sent[index] += len(arguments)
                if arguments or "id" in piece:
                    piece["function"]["arguments"] = arguments
            if piece["function"]:
                pieces.append(piece)
        if pieces:
            return {"tool_calls": pieces}
        if finished and not self.call_ids and text:
            return {"content": text}
        return {}


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
