"""Multi-turn needle retrieval (`kvforge eval niah --multi-turn K`).

One conversation hides K named pass keys ("the pass key of the red door is 48213") at
evenly spaced depths of one haystack, then asks for them one per turn in a seeded order.
Each turn's question follows the previous answer in the same sequence, so the cache built
for the haystack is reused by every turn; a method that evicts what the first question
did not need (H2O, SnapKV-style eviction) loses the other needles, a method that keeps
everything reachable (full, KIVI, ShadowKV) must not.

Plain-text prompts only (the chat template would need the generated reply re-rendered):

    <instruction>\\n\\n<haystack with K needles>\\n\\n<question 1><answer prefix 1>
    <reply 1>\\n\\n<question 2><answer prefix 2><reply 2> ...

The first prompt is filled to `length` tokens; later turns add a few dozen tokens each.
A conversation is deterministic for (seed, length, sample index).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvforge.errors import require
from kvforge.tools.eval.fit import largest_fitting
from kvforge.tools.eval.passkey import depth_grid, make_key, mean_sentence_tokens

COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "black", "white")
THINGS = ("door", "box", "lamp", "clock", "boat", "bell", "chair", "window", "garden", "tower")
INSTRUCTION = ("There are several important pieces of information hidden inside a lot of irrelevant text. "
               "Find them and memorize them. I will quiz you about each of them.")
NEEDLE = "The pass key of the {name} is {key}. Remember it. {key} is the pass key of the {name}."
QUESTION = "What is the pass key of the {name}?"
ANSWER_PREFIX = " The pass key of the {name} is"


@dataclass(frozen=True)
class Conversation:
    length: int  # target length of the first prompt in tokens
    sample_index: int
    names: tuple[str, ...]  # needle names, in haystack order (needle j at depths[j])
    keys: tuple[str, ...]
    depths: tuple[float, ...]
    order: tuple[int, ...]  # the needle asked in each turn
    turns: tuple[tuple[int, ...], ...]  # tokens the user adds per turn (turn 0: the whole prompt)

    @property
    def prompt_tokens(self) -> int:
        return len(self.turns[0])


def needle_names(rng: random.Random, count: int) -> list[str]:
    """`count` distinct "colour thing" names."""
    require(1 <= count <= len(COLOURS) * len(THINGS), "multi_turn", count,
            f"must be in [1, {len(COLOURS) * len(THINGS)}]")
    pairs = [f"{c} {t}" for c in COLOURS for t in THINGS]
    return rng.sample(pairs, count)


def ask(name: str) -> str:
    return f"\n\n{QUESTION.format(name=name)}{ANSWER_PREFIX.format(name=name)}"


def build_conversation(tokenizer: Any, length: int, turns: int, seed: int, sentences: Sequence[str],
                       sample_index: int = 0, key_digits: int = 5) -> Conversation:
    rng = random.Random(f"multiturn:{seed}:{length}:{sample_index}")
    names = needle_names(rng, turns)
    keys = [make_key(seed, length, 1000 + j, sample_index, key_digits) for j in range(turns)]
    require(len(set(keys)) == turns, "seed", seed, "gave repeated pass keys; pick another seed")
    depths = depth_grid(turns)
    order = list(range(turns))
    rng.shuffle(order)
    needles = [NEEDLE.format(name=n, key=k) for n, k in zip(names, keys)]

    def encode(count: int) -> list[int]:
        hay = [sentences[i % len(sentences)] for i in range(count)]
        cuts = [round(d * count) for d in depths]
        parts: list[str] = []
        for j, cut in enumerate(cuts):
            parts += hay[cuts[j - 1] if j else 0:cut] + [needles[j]]
        parts += hay[cuts[-1]:]
        text = f"{INSTRUCTION}\n\n{' '.join(parts)}{ask(names[order[0]])}"
        return list(tokenizer.encode(text))

    _, first = largest_fitting(encode, length, mean_sentence_tokens(tokenizer, sentences))
    later = [tuple(tokenizer.encode(ask(names[j]), add_special_tokens=False)) for j in order[1:]]
    return Conversation(length, sample_index, tuple(names), tuple(keys), tuple(depths), tuple(order),
                        (tuple(first), *later))


def build_conversations(tokenizer: Any, lengths: Sequence[int], turns: int, seed: int, sentences: Sequence[str],
                        samples: int = 1, key_digits: int = 5) -> list[Conversation]:
    return [build_conversation(tokenizer, n, turns, seed, sentences, s, key_digits)
            for n in lengths for s in range(samples)]


def turn_records(conversation: Conversation, outputs: Sequence[Sequence[int]], tokenizer: Any,
                 score: Any) -> list[dict[str, Any]]:
    """One record per turn: which needle was asked, its depth, the reply and whether it
    holds the key. A conversation cut short (no reply for a turn) scores those turns 0."""
    records = []
    for turn, needle in enumerate(conversation.order):
        generated = list(outputs[turn]) if turn < len(outputs) else []
        text = tokenizer.decode(generated, skip_special_tokens=True)
        key = conversation.keys[needle]
        records.append({"length": conversation.length, "sample": conversation.sample_index, "turn": turn,
                        "needle": conversation.names[needle], "depth": conversation.depths[needle],
                        "depth_index": needle, "key": key, "prompt_tokens": conversation.prompt_tokens,
                        "output": text, "output_ids": generated, "correct": score(key, text)})
    return records


def accuracy_by_turn(records: Sequence[dict[str, Any]], turns: int) -> list[float]:
    out = []
    for turn in range(turns):
        cell = [r["correct"] for r in records if r["turn"] == turn]
        out.append(sum(cell) / len(cell) if cell else float("nan"))
    return out
