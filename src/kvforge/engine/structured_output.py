"""Structured output: what a request's text must be (vLLM's `structured_outputs`, behind
OpenAI's `response_format` too): text that a JSON schema accepts, any JSON object, text a
regular expression matches in full, one string of a list, or text of a grammar (Lark, or
GBNF as llama.cpp writes it).

`StructuredOutputs` is the validated request field; `grammar_text` turns it into the
grammar llguidance compiles (`grammar_matcher.py` runs it against the tokens). Exactly one
kind of constraint is set. Nothing here imports llguidance until a grammar is made, so a
server without the package starts, and says what to install when a request asks for one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvforge.errors import ConfigError, is_unicode, require

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MISSING_PACKAGE = "needs the llguidance package (pip install 'kvforge[serve]', or pip install llguidance)"


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on a request's text; validated on construction.

    `json`: a JSON schema (a dict, or its JSON text); `regex`: the whole text matches it
    (Rust regex syntax); `choice`: the text is exactly one of these strings; `grammar`: a
    Lark grammar (GBNF is converted); `json_object`: any JSON object (OpenAI's JSON mode).
    `disable_any_whitespace` (vLLM's): JSON without whitespace between its tokens.
    `origin` names the request field it came from, for error messages."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    origin: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _dumps(self.json))  # a string: hashable, one spelling
        set_kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        require(len(set_kinds) == 1, self.origin, set_kinds or "none",
                f"must set exactly one of {', '.join(KINDS)}")
        require(isinstance(self.json_object, bool), self._param("json_object"), self.json_object, "must be a bool")
        require(isinstance(self.disable_any_whitespace, bool), self._param("disable_any_whitespace"),
                self.disable_any_whitespace, "must be a bool")
        if self.json is not None:
            require(isinstance(self.json, str), self._param("json"), type(self.json).__name__,
                    "must be a JSON schema: an object, or its JSON text")
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise ConfigError(self._param("json"), _short(self.json), f"is not JSON ({exc})") from None
            require(isinstance(schema, (dict, bool)), self._param("json"), _short(self.json),
                    "must be a JSON schema: an object (or true / false)")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            require(value is None or (isinstance(value, str) and value != ""), self._param(kind),
                    value, "must be a non-empty string")
        if self.choice is not None:
            choices = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            require(bool(choices) and all(isinstance(c, str) and c for c in choices), self._param("choice"),
                    self.choice, "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choices)
        texts = [self.json, self.regex, self.grammar, *(self.choice or ())]
        require(all(text is None or is_unicode(text) for text in texts), self.parameter, self.shown,
                "must be valid Unicode (no lone surrogate)")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def parameter(self) -> str:
        """The request field an error about this constraint names."""
        return self._param(self.kind)

    @property
    def shown(self) -> str:
        """The constraint itself, shortened, for error messages."""
        value = getattr(self, self.kind)
        return _short(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))

    def _param(self, name: str) -> str:
        """`structured_outputs.<name>`, or the field itself when it came from another one
        (`guided_regex`, `response_format`)."""
        return f"{self.origin}.{name}" if self.origin == "structured_outputs" else self.origin


# vLLM's structured_outputs options kvforge does not implement -> their neutral value
UNSUPPORTED_OPTIONS = {"disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None}


def constraint_fields(value: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """The StructuredOutputs fields of a vLLM `structured_outputs` object (the server's field,
    the CLI's --structured-outputs): ConfigError naming `<origin>.<key>` for a key vLLM does
    not define, or an option kvforge does not implement away from its neutral value."""
    known = {*KINDS, "disable_any_whitespace", *UNSUPPORTED_OPTIONS}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{origin}.{unknown[0]}", value[unknown[0]],
                          f"is not a structured_outputs field ({', '.join(sorted(known))})")
    for name, neutral in UNSUPPORTED_OPTIONS.items():
        if value.get(name) not in (None, neutral):
            raise ConfigError(f"{origin}.{name}", value[name], "is not supported by kvforge: must be omitted or null")
    return {key: item for key, item in value.items() if key not in UNSUPPORTED_OPTIONS and item is not None}


def grammar_text(constraint: StructuredOutputs) -> str:
    """The grammar llguidance compiles for `constraint` (not checked yet: the compiler checks
    it against a tokenizer). Raises ConfigError when llguidance is not installed or a GBNF
    grammar does not convert."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        raise ConfigError(constraint.parameter, constraint.shown, MISSING_PACKAGE) from None
    # llguidance's JSON compiler allows whitespace between tokens unless told otherwise
    compact = {"whitespace_flexible": False} if constraint.disable_any_whitespace else None
    kind = constraint.kind
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(constraint.json, overrides=compact)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=compact)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(constraint.regex)
        if kind == "choice":
            return "start: " + " | ".join(lark_literal(c) for c in constraint.choice or ())
        from llguidance.gbnf_to_lark import any_to_lark

        return LLMatcher.grammar_from_lark(any_to_lark(constraint.grammar))
    except Exception as exc:  # GBNF conversion, llguidance's own checks: the constraint is at fault
        raise ConfigError(constraint.parameter, constraint.shown, f"is not valid ({exc})") from None


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal matching exactly it: a JSON string, every character
    past ASCII (and DEL, which llguidance's lexer refuses raw) written as a \\u escape."""
    return json.dumps(text)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."
