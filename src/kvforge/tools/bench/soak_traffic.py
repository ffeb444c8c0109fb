"""The seeded traffic of `kvforge bench soak`: what each request is, and what the server
must answer to it.

Fractions of the requests (each drawn independently per request):
- 10% disconnects: a streamed completion or chat with a long output, which the client
  closes after its first few chunks;
- 5% bad requests, which the server must refuse with a 4xx before any engine work: token
  ids outside the vocabulary (400), sampling values out of range (400), an unknown model
  name (404);
- the rest served: completions and chats, streamed and not, and turns of multi-turn
  conversations that re-send the whole history (each turn's prompt extends the previous
  turn's: prefix sharing). A turn's assistant replies are fixed held-out text, not what the
  server answered, so the mix is a pure function of the seed.
Prompts are windows of held-out text at seeded offsets, of log-uniform lengths from a few
tokens to `max_prompt_tokens` (about 1,500 where the context allows): many short, some long.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DISCONNECT_FRACTION = 0.10
BAD_FRACTION = 0.05
SERVED_KINDS = ("completion", "completion-stream", "chat", "chat-stream", "conversation")
BAD_KINDS = ("bad-token-id", "bad-sampling", "bad-model")
KINDS = (*SERVED_KINDS, "disconnect", *BAD_KINDS)
EXPECTATIONS = ("ok", "disconnect", "refused")
MIN_PROMPT_TOKENS = 4
MAX_TURNS = 5
OPEN_CONVERSATIONS = 2  # conversations under way at once; a finished one makes room for a new one
UNKNOWN_MODEL = "no-such-model"
# Each: fields that make a valid body invalid, and the field the server must name.
BAD_SAMPLING = (
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": 0}, "n"),
)


@dataclass(frozen=True)
class SoakRequest:
    index: int
    kind: str  # one of KINDS
    path: str  # COMPLETIONS or CHAT
    body: dict[str, Any]
    expect: str  # "ok": 200 and a whole answer; "disconnect": 200, then the client leaves; "refused": 4xx
    disconnect_after: int = 0  # streamed chunks read before the client closes ("disconnect" only)
    conversation: int | None = None  # conversation number of a "conversation" turn
    bad_field: str | None = None  # the field a "refused" body gets wrong

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class _Conversation:
    number: int
    turns_left: int
    messages: list[dict[str, str]] = field(default_factory=list)


class TrafficMix:
    """Draws the soak's requests one after another from `seed`; the same arguments give
    the same requests. `text_ids` are the held-out text's token ids, `decode` turns a
    window of them into text (chat messages), `model` is the served model's name."""

    def __init__(self, seed: int, text_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                 vocab_size: int, model: str, max_prompt_tokens: int, max_output_tokens: int) -> None:
        if len(text_ids) <= max_prompt_tokens:
            raise ValueError(f"the held-out text has {len(text_ids)} tokens: it must be longer than "
                             f"max_prompt_tokens={max_prompt_tokens}")
        self.rng = random.Random(f"soak:{seed}")
        self.text_ids, self.decode = list(text_ids), decode
        self.vocab_size, self.model = vocab_size, model
        self.max_prompt_tokens, self.max_output_tokens = max_prompt_tokens, max_output_tokens
        self.open: list[_Conversation] = []
        self.conversations = 0

    def take(self, count: int) -> list[SoakRequest]:
        return [self.next(index) for index in range(count)]

    def next(self, index: int) -> SoakRequest:
        draw = self.rng.random()
        if draw < BAD_FRACTION:
            return self._bad(index, BAD_KINDS[self.rng.randrange(len(BAD_KINDS))])
        if draw < BAD_FRACTION + DISCONNECT_FRACTION:
            return self._disconnect(index)
        kind = SERVED_KINDS[self.rng.randrange(len(SERVED_KINDS))]
        if kind == "conversation":
            return self._turn(index)
        streamed = kind.endswith("-stream")
        if kind.startswith("completion"):
            return SoakRequest(index, kind, COMPLETIONS, self._completion(self._length(), streamed), "ok")
        return SoakRequest(index, kind, CHAT, self._chat([self._user(self._length())], streamed), "ok")

    # -- pieces ---------------------------------------------------------------------------
    def _length(self, most: int | None = None) -> int:
        """Log-uniform in [MIN_PROMPT_TOKENS, most]."""
        most = max(MIN_PROMPT_TOKENS, most or self.max_prompt_tokens)
        return min(most, int(math.exp(self.rng.uniform(math.log(MIN_PROMPT_TOKENS), math.log(most + 1)))))

    def _window(self, length: int) -> list[int]:
        start = self.rng.randrange(len(self.text_ids) - length)
        return self.text_ids[start:start + length]

    def _user(self, length: int) -> dict[str, str]:
        return {"role": "user", "content": self.decode(self._window(length))}

    def _sampling(self, streamed: bool, max_tokens: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens or self.rng.randint(1, self.max_output_tokens),
                                "stream": streamed}
        if self.rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=self.rng.randrange(1 << 20))
        if streamed and self.rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return body

    def _completion(self, length: int, streamed: bool, max_tokens: int | None = None) -> dict[str, Any]:
        return {**self._sampling(streamed, max_tokens), "prompt": self._window(length)}

    def _chat(self, messages: list[dict[str, str]], streamed: bool, max_tokens: int | None = None) -> dict[str, Any]:
        return {**self._sampling(streamed, max_tokens), "messages": messages}

    def _turn(self, index: int) -> SoakRequest:
        """The next turn of an open conversation, or the first of a new one."""
        if len(self.open) < OPEN_CONVERSATIONS:
            self.conversations += 1
            self.open.append(_Conversation(self.conversations, self.rng.randint(2, MAX_TURNS)))
        chat = self.open[self.rng.randrange(len(self.open))]
        # Every turn adds a question and a reply of at most a share of the longest prompt,
        # so the whole history stays within it.
        share = max(MIN_PROMPT_TOKENS, self.max_prompt_tokens // (2 * MAX_TURNS))
        question = self._length(share)
        chat.messages.append(self._user(question))
        body = self._chat(list(chat.messages), self.rng.random() < 0.5)
        reply = self._length(share)
        chat.messages.append({"role": "assistant", "content": self.decode(self._window(reply))})
        chat.turns_left -= 1
        if chat.turns_left == 0:
            self.open.remove(chat)
        return SoakRequest(index, "conversation", CHAT, body, "ok", conversation=chat.number)

    def _disconnect(self, index: int) -> SoakRequest:
        """A long streamed answer (ignore_eos: it cannot end early) the client leaves after
        1-3 chunks."""
        long = 4 * self.max_output_tokens
        if self.rng.random() < 0.5:
            body = self._completion(self._length(), True, long)
            path = COMPLETIONS
        else:
            body = self._chat([self._user(self._length())], True, long)
            path = CHAT
        body.update(ignore_eos=True, min_tokens=long)
        return SoakRequest(index, "disconnect", path, body, "disconnect", disconnect_after=self.rng.randint(1, 3))

    def _bad(self, index: int, kind: str) -> SoakRequest:
        streamed = self.rng.random() < 0.5
        length = self._length(64)
        if kind == "bad-token-id":
            prompt = self._window(length)
            prompt[self.rng.randrange(length)] = self.rng.choice((-1, self.vocab_size, self.vocab_size + 1000))
            return SoakRequest(index, kind, COMPLETIONS, {**self._sampling(streamed), "prompt": prompt}, "refused",
                               bad_field="prompt")
        on_chat = self.rng.random() < 0.5
        body = self._chat([self._user(length)], streamed) if on_chat else self._completion(length, streamed)
        path = CHAT if on_chat else COMPLETIONS
        if kind == "bad-model":
            body["model"] = UNKNOWN_MODEL
            return SoakRequest(index, kind, path, body, "refused", bad_field="model")
        fields, named = BAD_SAMPLING[self.rng.randrange(len(BAD_SAMPLING))]
        body.update(fields)
        return SoakRequest(index, kind, path, body, "refused", bad_field=named)
