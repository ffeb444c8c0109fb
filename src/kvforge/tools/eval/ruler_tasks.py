"""RULER-style synthetic long-context tasks (Hsieh et al., 2024), generated locally.

Thirteen RULER tasks minus the two QA ones (they need downloaded datasets):
- retrieval: `niah_single_1` (noise haystack, number value), `niah_single_2` (text
  haystack, number), `niah_single_3` (text haystack, UUID), `niah_multikey_1` (text
  haystack, 3 distractor needles with other keys), `niah_multikey_2` (the haystack is
  made of needles, number values), `niah_multikey_3` (needles only, UUID keys and values),
  `niah_multivalue` (4 values under one key), `niah_multiquery` (4 keys asked at once);
- multi-hop tracing: `vt` (a chain of 4 variable hops hidden in noise);
- aggregation: `cwe` (the 10 most common words of a list), `fwe` (the 3 most frequent
  coded words of a Zeta(2)-distributed text).

Each sample is deterministic for (seed, task, length, index): every random choice comes
from a `random.Random` seeded with that tuple as a string. The prompt is filled to the
largest haystack that keeps prompt + `max_new_tokens` within `length` tokens of the
model's own tokenizer. Scoring follows RULER: the fraction of references that appear in
the output (case-insensitive) for every task here ("all"); "part" (any reference) is
what RULER uses for its QA tasks.

Departure from RULER: `cwe` uses 30/3 occurrences of common/uncommon words from 4096
tokens up, and 6/2 below, so that the 10 common words fit in short contexts.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvforge.errors import ConfigError, require
from kvforge.models.tokenizer import encode_prompt
from kvforge.tools.eval.fit import largest_fitting
from kvforge.tools.eval.passkey import NOISE_SENTENCES, split_sentences

Metric = Literal["all", "part"]


@dataclass(frozen=True)
class RulerSample:
    task: str
    length: int
    index: int
    token_ids: tuple[int, ...]
    references: tuple[str, ...]
    metric: Metric
    max_new_tokens: int


@dataclass(frozen=True)
class Prompt:
    """A prompt as a function of its filler size: (body text, question, answer prefix,
    references) for `count` filler units."""

    render: Callable[[int], tuple[str, str, str, tuple[str, ...]]]


@dataclass(frozen=True)
class Sources:
    """Filler material: haystack sentences, and a word vocabulary for keys and lists."""

    sentences: tuple[str, ...]
    words: tuple[str, ...]


@dataclass(frozen=True)
class TaskSpec:
    name: str
    family: str
    max_new_tokens: int
    make: Callable[[random.Random, Sources, int], Prompt]  # (rng, sources, length) -> Prompt
    metric: Metric = "all"


# -- building blocks ---------------------------------------------------------------------
def vocabulary(text: str, limit: int = 5000) -> tuple[str, ...]:
    """Distinct lowercase alphabetic words of 4-10 letters, in order of first appearance."""
    seen: dict[str, None] = {}
    for word in re.findall(r"[A-Za-z]+", text):
        word = word.lower()
        if 4 <= len(word) <= 10 and word not in seen:
            seen[word] = None
            if len(seen) >= limit:
                break
    return tuple(seen)


def make_sources(text: str | None) -> Sources:
    """Sentences and words from `text` (a haystack file); noise sentences when None."""
    from kvforge.tools.text_data import default_text_file, read_text

    words_text = text if text is not None else read_text(default_text_file())
    sentences = tuple(split_sentences(text)) if text is not None else tuple(split_sentences(words_text))
    require(len(sentences) > 0, "haystack", len(sentences), "needs at least one sentence")
    words = vocabulary(words_text)
    require(len(words) >= 200, "haystack vocabulary", len(words), "needs >= 200 distinct words of 4-10 letters")
    return Sources(sentences, words)


def number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def uuid(rng: random.Random) -> str:
    hexes = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{hexes[:8]}-{hexes[8:12]}-{hexes[12:16]}-{hexes[16:20]}-{hexes[20:]}"


def needle(key: str, value: str, kind: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def with_needles(filler: Sequence[str], needles: Sequence[tuple[float, str]]) -> list[str]:
    """Insert each (depth in [0, 1], text) into the filler at round(depth * len)."""
    out = list(filler)
    for depth, text in sorted(needles, key=lambda item: item[0], reverse=True):
        out.insert(round(depth * len(filler)), text)
    return out


def cycle(units: Sequence[str], count: int) -> list[str]:
    return [units[i % len(units)] for i in range(count)]


def _niah_prompt(kind: str, queries: Sequence[str], references: tuple[str, ...],
                 body: Callable[[int], str]) -> Prompt:
    plural = len(references) > 1
    noun = kind if plural else kind.removesuffix("s")
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + " and " + queries[-1]
    instruction = (f"Some special magic {kind} are hidden inside the text below. Remember them: "
                   f"you will be asked about them afterwards.")
    question = f"What {'are all' if plural else 'is'} the special magic {noun} for {query} in the text above?"
    prefix = f" The special magic {noun} for {query} in the text above {'are' if plural else 'is'}:"
    return Prompt(lambda count: (f"{instruction}\n\n{body(count)}", question, prefix, references))


# -- the tasks ---------------------------------------------------------------------------
def _single(haystack: str, value_kind: str) -> Callable[[random.Random, Sources, int], Prompt]:
    def make(rng: random.Random, sources: Sources, length: int) -> Prompt:
        key = rng.choice(sources.words)
        value = uuid(rng) if value_kind == "uuid" else number(rng)
        kind = "uuids" if value_kind == "uuid" else "numbers"
        depth = rng.random()
        units = NOISE_SENTENCES if haystack == "noise" else sources.sentences
        return _niah_prompt(kind, [key], (value,),
                            lambda n: " ".join(with_needles(cycle(units, n), [(depth, needle(key, value, kind))])))
    return make


def _multikey_text(rng: random.Random, sources: Sources, length: int) -> Prompt:
    keys = rng.sample(sources.words, 4)
    values = [number(rng) for _ in keys]
    depths = [rng.random() for _ in keys]
    needles = [(d, needle(k, v, "numbers")) for d, k, v in zip(depths, keys, values)]
    return _niah_prompt("numbers", [keys[0]], (values[0],),
                        lambda n: " ".join(with_needles(cycle(sources.sentences, n), needles)))


def _needles_only(value_kind: str) -> Callable[[random.Random, Sources, int], Prompt]:
    """The haystack is made of needles with other keys; unit i is fixed for the sample."""
    def make(rng: random.Random, sources: Sources, length: int) -> Prompt:
        salt = rng.random()
        kind = "uuids" if value_kind == "uuid" else "numbers"
        target_key = uuid(rng) if value_kind == "uuid" else rng.choice(sources.words)
        target_value = uuid(rng) if value_kind == "uuid" else number(rng)
        others = [w for w in sources.words if w != target_key]
        random.Random(salt).shuffle(others)

        def unit(i: int) -> tuple[str, str]:
            """Filler needle i: a distinct key (word, numbered once the words run out)."""
            unit_rng = random.Random(f"{salt}:{i}")
            if value_kind == "uuid":
                return uuid(unit_rng), uuid(unit_rng)
            key = others[i % len(others)] + ("" if i < len(others) else f"-{i // len(others)}")
            return key, number(unit_rng)

        depth = rng.random()

        def body(n: int) -> str:
            filler = [needle(*unit(i), kind) for i in range(n)]
            return " ".join(with_needles(filler, [(depth, needle(target_key, target_value, kind))]))

        return _niah_prompt(kind, [target_key], (target_value,), body)
    return make


def _multivalue(rng: random.Random, sources: Sources, length: int) -> Prompt:
    key = rng.choice(sources.words)
    values = tuple(number(rng) for _ in range(4))
    needles = [(rng.random(), needle(key, v, "numbers")) for v in values]
    return _niah_prompt("numbers", [key], values,
                        lambda n: " ".join(with_needles(cycle(sources.sentences, n), needles)))


def _multiquery(rng: random.Random, sources: Sources, length: int) -> Prompt:
    keys = rng.sample(sources.words, 4)
    values = tuple(number(rng) for _ in keys)
    needles = [(rng.random(), needle(k, v, "numbers")) for k, v in zip(keys, values)]
    return _niah_prompt("numbers", keys, values,
                        lambda n: " ".join(with_needles(cycle(sources.sentences, n), needles)))


def _variable_tracking(rng: random.Random, sources: Sources, length: int, hops: int = 4) -> Prompt:
    names = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = sorted(rng.random() for _ in chain)  # assignments appear in order
    instruction = ("Remember every variable assignment in the text below and follow chains of "
                   "assignments from one variable to the next.")
    question = f"Which variables are assigned the value {value}, directly or through other variables? List all of them."
    prefix = f" Answer: the variables assigned the value {value} are:"
    return Prompt(lambda n: (f"{instruction}\n\n" + " ".join(with_needles(cycle(NOISE_SENTENCES, n),
                                                                          list(zip(depths, chain)))),
                             question, prefix, tuple(names)))


def _common_words(rng: random.Random, sources: Sources, length: int) -> Prompt:
    common_count, uncommon_count = (30, 3) if length >= 4096 else (6, 2)
    pool = list(sources.words)
    rng.shuffle(pool)
    common, uncommon = pool[:10], pool[10:]
    salt = rng.random()

    def render(n: int) -> tuple[str, str, str, tuple[str, ...]]:
        words = common * common_count + uncommon[:n] * uncommon_count
        random.Random(f"{salt}:{n}").shuffle(words)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        instruction = "Below is a numbered list of words. Some of the words occur many times."
        return (f"{instruction}\n\n{listing}", "Which 10 words occur most often in the list above?",
                " Answer: the 10 most common words in the list are:", tuple(common))

    return Prompt(render)


def _frequent_words(rng: random.Random, sources: Sources, length: int, alpha: float = 2.0) -> Prompt:
    vocab_rng = random.Random(rng.random())
    coded = []
    while len(coded) < 2000:
        word = "".join(vocab_rng.choice(string.ascii_lowercase) for _ in range(vocab_rng.randint(3, 6)))
        if word not in coded:
            coded.append(word)
    # Zeta(alpha) ranks, truncated to the vocabulary: P(rank k) proportional to k^-alpha.
    weights = [k ** -alpha for k in range(1, len(coded) + 1)]
    draws = rng.choices(coded, weights=weights, k=max(64, length))  # enough for any fit

    def render(n: int) -> tuple[str, str, str, tuple[str, ...]]:
        text = draws[:n]
        counts = Counter(text)
        top = tuple(sorted(counts, key=lambda w: (-counts[w], text.index(w)))[:3])
        instruction = "Below is a text of made-up coded words. Keep track of how often each coded word occurs."
        return (f"{instruction}\n\n{' '.join(text)}", "Which 3 coded words occur most often in the text above?",
                " Answer: the three most frequent coded words in the text are:", top)

    return Prompt(render)


TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (
    TaskSpec("niah_single_1", "niah", 128, _single("noise", "number")),
    TaskSpec("niah_single_2", "niah", 128, _single("text", "number")),
    TaskSpec("niah_single_3", "niah", 128, _single("text", "uuid")),
    TaskSpec("niah_multikey_1", "niah", 128, _multikey_text),
    TaskSpec("niah_multikey_2", "niah", 128, _needles_only("number")),
    TaskSpec("niah_multikey_3", "niah", 128, _needles_only("uuid")),
    TaskSpec("niah_multivalue", "niah", 128, _multivalue),
    TaskSpec("niah_multiquery", "niah", 128, _multiquery),
    TaskSpec("vt", "variable tracking", 30, _variable_tracking),
    TaskSpec("cwe", "aggregation", 120, _common_words),
    TaskSpec("fwe", "aggregation", 50, _frequent_words),
)}


def parse_tasks(text: str) -> list[str]:
    """`all` or a comma-separated list of task names (or families: niah, vt, cwe, fwe)."""
    if text.strip() == "all":
        return list(TASKS)
    names: list[str] = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        matched = [n for n in TASKS if n == item or n.startswith(item + "_")]
        if not matched:
            raise ConfigError("tasks", item, f"known tasks are all, {', '.join(TASKS)} (or the prefix niah)")
        names += [n for n in matched if n not in names]
    return names


def check_lengths(tasks: list[str], lengths: list[int]) -> None:
    """Every length leaves room for each task's answer: checked before any model or tokenizer loads."""
    for task in tasks:
        for length in lengths:
            require(length > TASKS[task].max_new_tokens, "lengths", length,
                    f"must exceed {task}'s {TASKS[task].max_new_tokens} answer tokens")


def build_sample(task: str, length: int, index: int, seed: int, tokenizer: Any, sources: Sources,
                 chat: bool = False) -> RulerSample:
    """One sample of `task`, filled to `length` tokens including its generation budget."""
    spec = TASKS[task]
    require(length > spec.max_new_tokens, "length", length, f"must exceed {task}'s {spec.max_new_tokens} answer tokens")
    rng = random.Random(f"ruler:{seed}:{task}:{length}:{index}")
    prompt = spec.make(rng, sources, length)

    def encode(count: int) -> list[int]:
        body, question, prefix, _ = prompt.render(count)
        if chat:
            return encode_prompt(tokenizer, [{"role": "user", "content": f"{body}\n\n{question}"}], chat=True)
        return encode_prompt(tokenizer, f"{body}\n\n{question}{prefix}", chat=False)

    count, ids = largest_fitting(encode, length - spec.max_new_tokens, tokens_per_unit=8.0, what="length")
    references = prompt.render(count)[3]
    return RulerSample(task, length, index, tuple(ids), references, spec.metric, spec.max_new_tokens)


def score(output: str, references: Sequence[str], metric: Metric = "all") -> float:
    """RULER's string match: the fraction of references in the output ("all"), or 1.0 if
    any is ("part"); case-insensitive."""
    require(len(references) > 0, "references", references, "must not be empty")
    found = [ref.lower() in output.lower() for ref in references]
    return float(any(found)) if metric == "part" else sum(found) / len(found)
