"""Log-probabilities in OpenAI's two shapes.

Completions (`logprobs: N`): parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a
dict token -> logprob of the N most likely, plus the chosen token, as vLLM reports it) and
`text_offset` (where each token's text starts in the choice's text). With `echo` the prompt
tokens come first; the first prompt token has no logprob (null) and no alternatives.

Chat (`logprobs: true, top_logprobs: N`): `content` is a list of {token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}] x N}.

A token's text is the tokenizer's decoding of that id alone; with vLLM's
`return_tokens_as_token_ids` each token is shown as "token_id:<id>" instead (two ids of one
text stay apart), while completions' `text_offset` and chat's `bytes` still describe the
token's text (vLLM counts the "token_id:<id>" form in both, for alternatives).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvforge.engine.sampling import TopLogprobs

TokenText = Callable[[int], str]


def token_id_text(token: int) -> str:
    """vLLM's `return_tokens_as_token_ids` form of a token."""
    return f"token_id:{token}"


@dataclass
class CompletionLogprobs:
    """Builds the completions `logprobs` object piece by piece (streaming appends)."""

    token_text: TokenText
    shown: TokenText | None = None  # how a token is written, when not as its text (token_id_text)
    offset: int = 0  # text_offset of the next token
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float | None],
            tops: Sequence[TopLogprobs] | None) -> None:
        show = self.shown or self.token_text
        for index, (token, logprob) in enumerate(zip(token_ids, logprobs)):
            shown = show(token)
            self.tokens.append(shown)
            self.token_logprobs.append(logprob)
            if logprob is None:  # the first prompt token: nothing predicts it
                self.top_logprobs.append(None)
            else:
                top = {show(i): value for i, value in (tops[index] if tops else [])}
                top.setdefault(shown, logprob)
                self.top_logprobs.append(top)
            self.text_offset.append(self.offset)
            self.offset += len(self.token_text(token))

    def take(self) -> dict[str, Any]:
        """The object so far; clears the lists (the offset runs on) for the next chunk."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def chat_logprobs(token_text: TokenText, token_ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[TopLogprobs] | None, shown: TokenText | None = None) -> dict[str, Any]:
    show = shown or token_text

    def entry(token: int, value: float) -> dict[str, Any]:
        return {"token": show(token), "logprob": value, "bytes": list(token_text(token).encode("utf-8"))}

    content = []
    for index, (token, value) in enumerate(zip(token_ids, logprobs)):
        item = entry(token, value)
        item["top_logprobs"] = [entry(i, v) for i, v in (tops[index] if tops else [])]
        content.append(item)
    return {"content": content}
