"""Log-probabilities in OpenAI's two shapes.

Completions (`logprobs: N`): parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a
dict token -> logprob of the N most likely, plus the chosen token, as vLLM reports it) and
`text_offset` (where each token's text starts in the choice's text). With `echo` the prompt
tokens come first; the first prompt token has no logprob (null) and no alternatives.

Chat (`logprobs: true, top_logprobs: N`): `content` is a list of {token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}] x N}.

A token's text is the tokenizer's decoding of that id alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvforge.engine.sampling import TopLogprobs

TokenText = Callable[[int], str]


@dataclass
class CompletionLogprobs:
    """Builds the completions `logprobs` object piece by piece (streaming appends)."""

    token_text: TokenText
    offset: int = 0  # text_offset of the next token
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float | None],
            tops: Sequence[TopLogprobs] | None) -> None:
        for index, (token, logprob) in enumerate(zip(token_ids, logprobs)):
            text = self.token_text(token)
            self.tokens.append(text)
            self.token_logprobs.append(logprob)
            if logprob is None:  # the first prompt token: nothing predicts it
                self.top_logprobs.append(None)
            else:
                top = {self.token_text(i): value for i, value in (tops[index] if tops else [])}
                top.setdefault(text, logprob)
                self.top_logprobs.append(top)
            self.text_offset.append(self.offset)
            self.offset += len(text)

    def take(self) -> dict[str, Any]:
        """The object so far; clears the lists (the offset runs on) for the next chunk."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def chat_logprobs(token_text: TokenText, token_ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[TopLogprobs] | None) -> dict[str, Any]:
    def entry(token: int, value: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for index, (token, value) in enumerate(zip(token_ids, logprobs)):
        item = entry(token, value)
        item["top_logprobs"] = [entry(i, v) for i, v in (tops[index] if tops else [])]
        content.append(item)
    return {"content": content}
