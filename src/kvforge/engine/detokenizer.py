"""Incremental detokenisation: text of generated ids, updated token by token.

Decoding the whole output after each token costs O(n) per token. Instead we decode a
short window: the text of ids[prefix:] minus the text of ids[prefix:read] is the new text.
`read` is where the text so far ends; `prefix` is where the previous piece began, so the
window starts with at least one token of left context (tokenizers that drop a leading
space from the first token of a decoding keep it for the new token) and always on a
character boundary: a piece is taken only when the window decodes to complete characters,
so a window never starts inside a multi-byte character. (Starting a fixed number of tokens
back could: byte-fallback decoders then turn the whole run of byte tokens into "\ufffd".)
A new piece that ends in an incomplete UTF-8 sequence ("\ufffd") is held back until the
next token completes it.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decoding window: where the previous piece began
        self._read = 0  # ids before this are already reflected in `text`

    def add(self, token_id: int) -> str:
        """Append one id; returns the text it completes (possibly empty)."""
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(  # noqa: E731
            ids, skip_special_tokens=self.skip_special_tokens)
        before = decode(self.ids[self._prefix:self._read])
        after = decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before):]
        self.text += piece
        self._prefix = self._read
        self._read = len(self.ids)
        return piece
