"""Pass-key retrieval samples: a random key hidden at a given depth of a haystack, filled to
a given number of tokens with the model's own tokenizer; and the scorer.

A sample is deterministic for (seed, length, depth index, sample index): the key comes
from a `random.Random` seeded with that tuple as a string (stable across processes and
Python versions), and the haystack is a fixed sequence of sentences (noise sentences, or
the sentences of a text file, repeated as needed). Prompt layout (plain text):

    <instruction>\n\n<haystack[:i]> <needle> <haystack[i:]>\n\n<question><answer prefix>

where i = round(depth * sentences), depth in [0, 1]. With `chat`, the instruction,
haystack and question form one user message rendered by the chat template with the
generation prompt, and the answer prefix is left out.

The total number of tokens is the largest haystack that keeps the prompt <= `length`
(so prompts are within a few tokens of `length`, never above).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvforge.errors import require
from kvforge.models.tokenizer import encode_prompt
from kvforge.tools.eval.fit import largest_fitting

NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")
INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about the important information there.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = " The pass key is"


@dataclass(frozen=True)
class PasskeySample:
    length: int  # target length in tokens
    depth: float  # needle position as a fraction of the haystack, in [0, 1]
    depth_index: int
    sample_index: int
    key: str
    token_ids: tuple[int, ...]

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


def depth_grid(count: int) -> list[float]:
    """`count` depths evenly spaced over [0, 1] (0 and 1 included; 0.5 for one)."""
    require(count >= 1, "depths", count, "must be >= 1")
    return [0.5] if count == 1 else [i / (count - 1) for i in range(count)]


def make_key(seed: int, length: int, depth_index: int, sample_index: int, digits: int = 5) -> str:
    require(digits >= 1, "key_digits", digits, "must be >= 1")
    rng = random.Random(f"passkey:{seed}:{length}:{depth_index}:{sample_index}")
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def split_sentences(text: str) -> list[str]:
    """Sentences of a text (ends at . ! ? followed by space), whitespace-normalised."""
    flat = " ".join(text.split())
    return [s for s in re.split(r"(?<=[.!?])\s+", flat) if s]


def render(instruction: str, before: Sequence[str], needle: str, after: Sequence[str], chat: bool) -> str | list:
    """The prompt text (or chat messages) for a haystack split around the needle."""
    haystack = " ".join([*before, needle, *after])
    if chat:
        return [{"role": "user", "content": f"{instruction}\n\n{haystack}\n\n{QUESTION}"}]
    return f"{instruction}\n\n{haystack}\n\n{QUESTION}{ANSWER_PREFIX}"


def build_sample(tokenizer: Any, length: int, depth: float, key: str, sentences: Sequence[str],
                 chat: bool = False, depth_index: int = 0, sample_index: int = 0) -> PasskeySample:
    """The longest prompt <= `length` tokens with the needle at `depth` of the haystack."""
    require(0.0 <= depth <= 1.0, "depth", depth, "must be in [0, 1]")
    require(len(sentences) > 0, "haystack", len(sentences), "needs at least one sentence")
    needle = NEEDLE.format(key=key)

    def encode(count: int) -> list[int]:
        hay = [sentences[i % len(sentences)] for i in range(count)]
        cut = round(depth * count)
        return encode_prompt(tokenizer, render(INSTRUCTION, hay[:cut], needle, hay[cut:], chat), chat=chat)

    return PasskeySample(length, depth, depth_index, sample_index, key,
                         tuple(largest_fitting(encode, length, mean_sentence_tokens(tokenizer, sentences))[1]))


def mean_sentence_tokens(tokenizer: Any, sentences: Sequence[str]) -> float:
    """Average tokens per haystack sentence over the first 50 (an estimate for the search)."""
    head = sentences[:50]
    return max(1.0, sum(len(tokenizer.encode(s, add_special_tokens=False)) for s in head) / len(head))


def build_grid(tokenizer: Any, lengths: Sequence[int], depths: int, seed: int, sentences: Sequence[str],
               chat: bool = False, samples: int = 1, key_digits: int = 5) -> list[PasskeySample]:
    """Samples for every (length, depth, sample index), in that order."""
    out = []
    for length in lengths:
        for depth_index, depth in enumerate(depth_grid(depths)):
            for sample_index in range(samples):
                key = make_key(seed, length, depth_index, sample_index, key_digits)
                out.append(build_sample(tokenizer, length, depth, key, sentences, chat, depth_index, sample_index))
    return out


def check_key_fits(tokenizer: Any, keys: Sequence[str], max_new_tokens: int) -> None:
    """Refuse a run whose generation budget cannot hold the pass key it is scored on: every
    such sample would score 0% whatever the cache. The key's digits alone are counted (the
    fewest tokens an answer can take; a reply would usually add a space or more), and digits
    per token depend on the tokenizer, hence the check here and not on --key-digits alone."""
    longest = max(len(tokenizer.encode(key, add_special_tokens=False)) for key in keys)
    require(max_new_tokens >= longest, "max_new_tokens", max_new_tokens,
            f"must be at least the pass key's {longest} tokens ({len(max(keys, key=len))} digits "
            "under this tokenizer); raise --max-new-tokens or lower --key-digits")


def score_output(key: str, output: str) -> bool:
    """Correct when the key appears in the generated text as a whole number (not inside a
    longer run of digits)."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", output) is not None
