"""`kvforge chat`: an interactive conversation that stays on the engine.

Each turn's prompt is built from the previous turn's token ids (its prompt and the reply
as generated, end-of-turn token included) followed by the chat template's rendering of
what the new message adds, so the engine's prefix cache finds every earlier turn and
computes only the new message. When the template's rendering of the history does not begin
with the text of those ids (a template that rewrites earlier turns), the whole
conversation is encoded afresh and the cache reuses what still matches.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from typing import Any

from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling import SamplingParams
from kvforge.models.tokenizer import encode_prompt

COMMANDS = {"/reset": "forget the conversation", "/exit": "quit", "/help": "list these commands"}
COMMAND_WORD = re.compile(r"/[A-Za-z_]+")  # "/reste" is a typo; "/usr/bin ..." or "/ 2" is a message


def read_line(line: str) -> tuple[str, str]:
    """One line of input -> (kind, text): ("exit", ""), ("message", text), ("command", NAME)
    for a known command, ("unknown", WORD) for a slash word that is none of them, or
    ("blank", ""). A line starting with "//" is a message with one slash removed, so any text
    can be sent. End of input (an empty string, not an empty line) exits."""
    if not line:
        return "exit", ""
    text = line.strip()
    if not text:
        return "blank", ""
    if text.startswith("//"):
        return "message", text[1:]
    word = text.split()[0]
    if word in COMMANDS:
        return ("exit", "") if word == "/exit" else ("command", word)
    if COMMAND_WORD.fullmatch(word):
        return "unknown", word
    return "message", text


def command_help() -> str:
    listed = ", ".join(f"{name} ({what})" for name, what in COMMANDS.items())
    return f"commands: {listed}; begin a line with // to send one that starts with /"


class ChatSession:
    def __init__(self, llm: Any, system: str | None = None) -> None:
        self.llm = llm
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self.ids: list[int] = []  # the conversation so far as the engine saw and produced it

    def prompt_ids(self) -> list[int]:
        tokenizer = self.llm.tokenizer
        if self.ids:
            rendered = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
            before = tokenizer.decode(self.ids, skip_special_tokens=False)
            if rendered.startswith(before):
                return self.ids + tokenizer.encode(rendered[len(before):], add_special_tokens=False)
        return encode_prompt(tokenizer, self.messages, chat=True)

    def ask(self, text: str, params: SamplingParams) -> Iterator[RequestOutput]:
        """Stream the reply to `text`; the turn joins the conversation when it completes."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.prompt_ids()
        final = None
        for output in self.llm.stream([prompt], params):
            final = output
            yield output
        if final is None or final.error:
            self.messages.pop()
            return
        self.messages.append({"role": "assistant", "content": final.text})
        self.ids = prompt + final.token_ids


def run_chat(args: argparse.Namespace, llm: Any, params: SamplingParams) -> int:
    session = ChatSession(llm, args.system)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        kind, text = read_line(sys.stdin.readline())
        if kind == "exit":
            return 0
        if kind == "command" and text == "/reset":
            session.reset()
        elif kind == "command":
            print(command_help(), file=sys.stderr)
        elif kind == "unknown":
            print(f"kvforge chat: unknown command {text}; {command_help()}", file=sys.stderr)
        if kind != "message":
            continue
        print("assistant> ", end="", flush=True)
        final = None
        before = llm.engine.prefix_statistics()
        for output in session.ask(text, params):
            print(output.new_text, end="", flush=True)
            final = output
            if output.error:
                print(f"\nkvforge chat: error: {output.error}", file=sys.stderr)
        print()
        if args.stats and final is not None and not final.error:
            after = llm.engine.prefix_statistics()
            hit = after.get("prefix_hit_tokens", 0) - before.get("prefix_hit_tokens", 0)
            print(f"[prompt {len(final.prompt_token_ids)} tokens, {hit} from the prefix cache; time to first "
                  f"token {final.metrics.time_to_first_token:.2f} s]", file=sys.stderr)
