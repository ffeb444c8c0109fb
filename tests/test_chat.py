"""`kvforge chat` keeps its conversation on the engine: each turn's prompt begins with the
previous turn's tokens as the engine produced them, so earlier turns come from the prefix
cache (whole pages for `full`, the whole kept sequence for `kivi` with prefix_reuse=continue)."""

from __future__ import annotations

import argparse
import io

import pytest
import torch
from server_helpers import char_tokenizer, make_engine, tiny_model

from kvforge.chat import ChatSession, read_line, run_chat
from kvforge.engine.llm import LLM
from kvforge.engine.sampling import SamplingParams


def _llm(cache: str) -> LLM:
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    llm = object.__new__(LLM)  # the facade around a tiny engine (no model files)
    llm.tokenizer, llm.engine = tokenizer, make_engine(tiny_model(), tokenizer, cache=cache)
    return llm


@pytest.mark.parametrize("cache", ["full:block_size=8", "kivi:bits=4,group=8,residual=16,prefix_reuse=continue"])
def test_later_turns_reuse_earlier_turns(cache):
    llm = _llm(cache)
    session = ChatSession(llm, system="be brief")
    params = SamplingParams.greedy_params(max_tokens=12, ignore_eos=True)
    hits = []
    for question in ("hello there", "and then?", "why?"):
        before = llm.engine.prefix_statistics()["prefix_hit_tokens"]
        *_, final = session.ask(question, params)
        hits.append(llm.engine.prefix_statistics()["prefix_hit_tokens"] - before)
        assert final.finished and final.error is None
    assert hits[0] == 0 and hits[1] > 0 and hits[2] > hits[1]
    # the third prompt began with everything the second turn computed
    assert session.messages[-1]["role"] == "assistant" and len(session.messages) == 7
    if cache.startswith("kivi"):  # continuation: every computed token of the last turn is reused
        assert llm.engine.prefix_statistics()["prefix_continued_sequences"] == 2


def test_the_prompt_extends_the_previous_ids_exactly():
    """With a template that ends each turn with the EOS token (as SmolLM2's does), the
    next prompt is the previous ids plus the new turn's rendering; when the rendering does
    not begin with the previous text (here: a reply with a special token the template
    drops), the conversation is encoded afresh."""
    llm = _llm("full:block_size=8")
    llm.tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
                                   "{% if add_generation_prompt %}<assistant>{% endif %}")
    session = ChatSession(llm)
    tokenizer = llm.tokenizer
    session.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "abc"}]
    first = tokenizer.apply_chat_template(session.messages[:1], add_generation_prompt=True, tokenize=False)
    session.ids = tokenizer.encode(first, add_special_tokens=False) + tokenizer.encode("abc") + [tokenizer.eos_token_id]
    session.messages.append({"role": "user", "content": "more"})
    prompt = session.prompt_ids()
    assert prompt[:len(session.ids)] == session.ids and len(prompt) > len(session.ids)
    rendered = tokenizer.apply_chat_template(session.messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(prompt, skip_special_tokens=False) == rendered
    session.ids[-1] = 0  # <unk> instead of the end of turn: the text no longer matches
    assert session.prompt_ids() == tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("line, expected", [
    ("", ("exit", "")),  # end of input
    ("\n", ("blank", "")),
    ("/exit\n", ("exit", "")),
    ("/reset\n", ("command", "/reset")),
    ("  /help me\n", ("command", "/help")),
    ("/reste\n", ("unknown", "/reste")),  # a typo is not sent to the model
    ("/clear now\n", ("unknown", "/clear")),
    ("//reset is a command\n", ("message", "/reset is a command")),
    ("/usr/bin holds what?\n", ("message", "/usr/bin holds what?")),
    ("/ 2 is a slash\n", ("message", "/ 2 is a slash")),
    (" hello /reset\n", ("message", "hello /reset")),
])
def test_each_line_is_a_command_a_message_or_refused(line, expected):
    assert read_line(line) == expected


def test_an_unknown_command_is_explained_and_not_sent(monkeypatch, capsys):
    llm = _llm("full:block_size=8")
    monkeypatch.setattr("sys.stdin", io.StringIO("/reste\n/help\nhello\n/exit\nnever read\n"))
    params = SamplingParams.greedy_params(max_tokens=3, ignore_eos=True)
    assert run_chat(argparse.Namespace(system=None, stats=False), llm, params) == 0
    out, err = capsys.readouterr()
    assert out.count("assistant> ") == 1  # only "hello" reached the model
    assert "unknown command /reste; commands: /reset (forget the conversation)" in err
    assert err.count("commands: ") == 2 and "//" in err
