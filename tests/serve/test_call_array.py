"""A "required" tool reply read while it grows (serve/call_array.py, serve/tool_calls.py):
fed the reply in pieces of any sizes, the streamed calls join to exactly the finished
reply's calls, names and arguments as written, whatever the JSON inside the arguments
(strings holding quotes, brackets and escapes, nesting, whitespace, key order)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tool_calls import joined_calls

from kvforge.serve.call_array import CallArrayReader, scan_calls
from kvforge.serve.tool_calls import ToolCallDeltas, ToolPlan

PLAN = ToolPlan([], "required")
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)
LAYOUTS = [{"separators": (",", ":")}, {"separators": (", ", ": ")}, {"indent": 1}, {"indent": 2, "ensure_ascii": False}]


def reply(calls: list[tuple[str, Any]], layout: dict[str, Any], parameters_first: bool) -> tuple[str, list[tuple[str, str]]]:
    """The reply's text and its calls (name, the arguments' text as written)."""
    items, expected = [], []
    for name, parameters in calls:
        arguments = json.dumps(parameters, **layout)
        members = [f'"name": {json.dumps(name)}', f'"parameters": {arguments}']
        items.append("{" + ", ".join(reversed(members) if parameters_first else members) + "}")
        expected.append((name, arguments))
    return "[\n " + ",\n ".join(items) + "\n]", expected


def stream(text: str, cuts: list[int]) -> list[dict[str, Any]]:
    deltas, pieces = ToolCallDeltas(PLAN), []
    ends = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    start = 0
    for end in ends:
        delta = deltas.delta(text[start:end], end == len(text), text[:end])
        pieces += delta.get("tool_calls", [])
        assert "content" not in delta
        start = end
    return pieces


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["weather", 'say "hi"', "a\\b", "{x}"]),
                                st.dictionaries(st.text(max_size=6), JSON, max_size=3)), min_size=1, max_size=3),
       layout=st.sampled_from(LAYOUTS), parameters_first=st.booleans(),
       cuts=st.lists(st.integers(0, 400), max_size=30))
def test_streamed_calls_join_to_the_finished_calls(calls, layout, parameters_first, cuts):
    text, expected = reply(calls, layout, parameters_first)
    joined = joined_calls(stream(text, cuts))
    assert [(c["name"], c["arguments"]) for c in joined] == expected
    finished = PLAN.calls(text)
    assert finished is not None and [(c["function"]["name"], c["function"]["arguments"]) for c in finished] == expected
    one_at_a_time = joined_calls(stream(text, list(range(len(text)))))
    assert [(c["name"], c["arguments"]) for c in one_at_a_time] == expected


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["weather", 'say "hi"']),
                                st.dictionaries(st.text(max_size=6), JSON, max_size=3)), min_size=1, max_size=3),
       layout=st.sampled_from(LAYOUTS), cuts=st.lists(st.integers(0, 400), max_size=30),
       tail=st.sampled_from(["", "]", ", x", "}", "\"\\"]))
def test_a_reader_fed_piece_by_piece_reads_what_a_fresh_read_does(calls, layout, cuts, tail):
    text = reply(calls, layout, parameters_first=False)[0][:-1] + tail  # closed or cut or broken at the end
    reader = CallArrayReader()
    for end in sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]:
        assert reader.read(text[:end]) == scan_calls(text[:end])
        assert reader.seen == end


def test_a_streamed_reply_is_read_once_however_many_pieces_it_comes_in(monkeypatch):
    """Each step's read starts where the last one stopped: one look per character, where
    reading the whole text again at every token cost seconds of the event loop for a long
    call's arguments."""
    looks = 0
    step = CallArrayReader._step

    def counted(self, text, i):
        nonlocal looks
        looks += 1
        step(self, text, i)

    monkeypatch.setattr(CallArrayReader, "_step", counted)
    text, expected = reply([("write_file", {"path": "a.py", "text": "x = 1\n" * 400}), ("clock", {})],
                           {"separators": (", ", ": ")}, parameters_first=False)
    joined = joined_calls(stream(text, list(range(len(text)))))
    assert [(c["name"], c["arguments"]) for c in joined] == expected
    assert looks == len(text)


def test_a_reader_refuses_a_text_that_shrank():
    reader = CallArrayReader()
    reader.read('[{"name": "f"')
    with pytest.raises(ValueError, match="shrank from 13 to 2"):
        reader.read("[{")


def test_every_prefix_reads_no_further_than_it_holds():
    text, expected = reply([("weather", {"city": "pa]}\"ris", "days": [1, {"x": "}"}]}), ("clock", {})],
                           {"separators": (", ", ": ")}, parameters_first=False)
    for end in range(len(text) + 1):
        for span in scan_calls(text[:end]):
            if span.arguments_end is not None:
                assert span.arguments_end <= end
                json.loads(text[span.arguments_start:span.arguments_end])  # a closed value is whole JSON
    spans = scan_calls(text)
    assert [(s.name, text[s.arguments_start:s.arguments_end]) for s in spans] == expected


def test_a_reply_that_is_not_whole_calls_is_no_calls():
    for text in ["", "[]", "[{\"name\": \"f\"}]", "[{\"parameters\": {}}]", "[{\"name\": \"f\", \"parameters\": {}}",
                 "{\"name\": \"f\", \"parameters\": {}}"]:
        assert PLAN.calls(text) is None and not PLAN.complete(text), text
    assert PLAN.calls('[{"name": "f", "parameters": {"a": 1}}]')[0]["function"]["arguments"] == '{"a": 1}'
