"""Reading a "required" tool reply while it grows: the JSON array
`[{"name": ..., "parameters": {...}}, ...]` that the reply's constraint shapes, read for
what each call has so far: its name once that string is closed, and where its parameters'
text starts and (once closed) ends.

The reader reads the text as written (whitespace included), so the arguments a stream sends
piece by piece join to exactly the text the finished reply reports. It keeps its place
between reads, so a reply that grows one token at a time is read once in all: each
character is looked at once however many times the stream asks (a reply's arguments may be
a long file's text, and the reader runs on the server's event loop).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"


@dataclass
class CallSpan:
    name: str | None = None  # None until the name's string is closed
    arguments_start: int | None = None  # where the parameters' value starts in the text
    arguments_end: int | None = None  # where it ends, once closed


@dataclass
class CallArrayReader:
    """Reads a growing reply: `read(text)` with the whole text so far, each text extending the
    last one. Where the text stops being an array of objects, reading stops for good and the
    calls read before it stand. Invariant: `seen` characters have been read, each once."""

    calls: list[CallSpan] = field(default_factory=list)
    seen: int = 0
    _phase: str = "start"  # start, array, key, colon, value, after_value, nested, done
    _depth: int = 0  # containers open inside the current member's value
    _in_string: bool = False
    _escaped: bool = False
    _in_scalar: bool = False
    _token_start: int = 0  # where the current key or member value starts
    _key: str = ""

    def read(self, text: str) -> list[CallSpan]:
        """The calls of `text` so far, in order; what cannot be read yet (an unclosed string, a
        value still growing) is left None."""
        if len(text) < self.seen:
            raise ValueError(f"the reply shrank from {self.seen} to {len(text)} characters")
        for i in range(self.seen, len(text)):
            if self._phase == "done":
                break
            self._step(text, i)
        self.seen = len(text)
        return self.calls

    def _step(self, text: str, i: int) -> None:
        char = text[i]
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._phase == "key":
                    self._key = json.loads(text[self._token_start:i + 1])
                    self._phase = "colon"
                elif self._depth == 0:
                    self._value_ended(text, i + 1)
            return
        if self._in_scalar:
            if char not in ",}]" + WHITESPACE:
                return
            self._in_scalar = False
            self._value_ended(text, i)  # and the delimiter is read below, at the call's level
        phase = self._phase
        if char in WHITESPACE:
            return
        if phase == "start":
            self._phase = "array" if char == "[" else "done"
        elif phase == "array":
            if char == "{":
                self.calls.append(CallSpan())
                self._phase = "key"
            elif char != ",":
                self._phase = "done"
        elif phase in ("key", "after_value"):
            if char == "}":
                self._phase = "array"
            elif char == "," and phase == "after_value":
                self._phase = "key"
            elif char == '"' and phase == "key":
                self._in_string, self._token_start = True, i
            else:
                self._phase = "done"
        elif phase == "colon":
            self._phase = "value" if char == ":" else "done"
        elif phase == "value":
            self._value_started(i)
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth, self._phase = 1, "nested"
            elif char in ",}]":
                self._phase = "done"
            else:
                self._in_scalar = True
        elif phase == "nested":
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._value_ended(text, i + 1)

    def _value_started(self, i: int) -> None:
        self._token_start = i
        if self._key == "parameters":
            self.calls[-1].arguments_start = i

    def _value_ended(self, text: str, end: int) -> None:
        call, start = self.calls[-1], self._token_start
        if self._key == "parameters":
            call.arguments_end = end
        elif self._key == "name" and text[start] == '"':
            call.name = json.loads(text[start:end])
        self._phase = "after_value"


def scan_calls(text: str) -> list[CallSpan]:
    """The calls of a (possibly unfinished) reply read at once; see `CallArrayReader`."""
    return CallArrayReader().read(text)
