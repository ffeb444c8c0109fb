"""Reading a "required" tool reply while it grows: the JSON array
`[{"name": ..., "parameters": {...}}, ...]` that the reply's constraint shapes, scanned
from its start for what each call has so far: its name once that string is closed, and
where its parameters' text starts and (once closed) ends.

The scan reads the text as written (whitespace included), so the arguments a stream sends
piece by piece join to exactly the text the finished reply reports. The text is short (a
reply's tool calls), so it is scanned again whole at each step rather than kept as a
parser's state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"


@dataclass
class CallSpan:
    name: str | None = None  # None until the name's string is closed
    arguments_start: int | None = None  # where the parameters' value starts in the text
    arguments_end: int | None = None  # where it ends, once closed


def scan_calls(text: str) -> list[CallSpan]:
    """The calls of a (possibly unfinished) reply, in order; what cannot be read yet (an
    unclosed string, a value still growing) is left None. Text that is not an array of
    objects gives what was read before it."""
    calls: list[CallSpan] = []
    i = _skip_whitespace(text, 0)
    if i >= len(text) or text[i] != "[":
        return calls
    i += 1
    while True:
        i = _skip_whitespace(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_whitespace(text, i + 1)
        if i >= len(text) or text[i] != "{":
            return calls
        call = CallSpan()
        calls.append(call)
        i = _scan_call(text, i + 1, call)
        if i is None:
            return calls


def _scan_call(text: str, i: int, call: CallSpan) -> int | None:
    """Reads one call's members from just after its "{"; the index after its "}", or None
    when the text ends first."""
    while True:
        i = _skip_whitespace(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_whitespace(text, i + 1)
        if i >= len(text):
            return None
        if text[i] == "}":
            return i + 1
        key_end = _value_end(text, i)
        if key_end is None or text[i] != '"':
            return None
        key = json.loads(text[i:key_end])
        i = _skip_whitespace(text, key_end)
        if i >= len(text) or text[i] != ":":
            return None
        start = _skip_whitespace(text, i + 1)
        if start >= len(text):
            return None
        end = _value_end(text, start)
        if key == "parameters":
            call.arguments_start, call.arguments_end = start, end
        elif key == "name" and end is not None and text[start] == '"':
            call.name = json.loads(text[start:end])
        if end is None:
            return None
        i = end


def _value_end(text: str, i: int) -> int | None:
    """The index just after the JSON value starting at `i`, or None when the text ends
    before the value does (a number or literal at the very end may still grow)."""
    first = text[i]
    if first == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if first in "{[":
        depth, j = 0, i
        while j < len(text):
            char = text[j]
            if char == '"':
                end = _value_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) else None


def _skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i
