"""vLLM's `bad_words`: words a request must not generate.

Each word becomes one or two token sequences (`bad_word_sequences`): the word as it
tokenizes alone, and with a leading space when the space makes a different first token
and the same number of tokens (a word-initial token, as most tokenizers have one for " the"
and another for "the"). At each step, a sequence of one token bans that token; a longer
one bans its last token when the output ends with the rest (`banned_by_bad_words`): the
word can never be completed. Only the output is read, as vLLM does: a word that would
start in the prompt is not followed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvforge.errors import ConfigError

MAX_BAD_WORDS = 128  # words (vLLM's default VLLM_MAX_NUM_BAD_WORDS counts their token sequences)


def bad_word_sequences(tokenizer: Any | None, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `words` (see the module docstring), in order, without repeats."""
    if not words:
        return ()
    if tokenizer is None:
        raise ConfigError("bad_words", list(words)[:3], "needs a tokenizer, and this model has none (dummy weights)")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise ConfigError("bad_words", word, "must tokenize to at least one token")
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for sequence in (bare, spaced):
            if sequence and sequence not in sequences and (
                    sequence is bare or (sequence[0] != bare[0] and len(sequence) == len(bare))):
                sequences.append(sequence)
    return tuple(sequences)


def banned_by_bad_words(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> set[int]:
    """The ids that would complete one of `sequences` now, after `output`."""
    banned = set()
    for sequence in sequences:
        before = len(sequence) - 1
        if before > len(output):
            continue
        if before == 0 or list(output[-before:]) == list(sequence[:before]):
            banned.add(sequence[-1])
    return banned
