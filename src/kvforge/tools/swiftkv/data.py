"""Distillation data: samples from text, chat JSONL or the teacher itself, packed into
fixed-length rows.

A `Sample` is token ids plus `counted`: counted[t] says whether the model's distribution at
position t (its prediction of token t + 1) enters the loss. Plain text counts every
position; chat and self-generated samples count the positions that predict a response
(assistant) token, so the prompt only conditions.

Packing puts several samples in one row of `seq_len` tokens; `segments` numbers them so the
dense forward keeps attention within a sample and restarts positions at each sample
(`kvforge.models.dense.segment_positions`). Text is split across rows freely (every row is
full); chat samples are kept whole (a row is padded when the next one does not fit; a
sample longer than a row is truncated). Padding has its own segment and never counts.

Everything that can be wrong with a data file (missing, empty, malformed JSON, a chat file
without assistant turns) is checked by `check_data_source` before any model is loaded.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvforge.errors import ConfigError
from kvforge.tools.text_data import default_text_file, split_train_heldout

_ARTICLE_TITLE = re.compile(r"^ = [^=].* = \r?$", re.MULTILINE)
CHAT_SUFFIX = ".jsonl"


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    counted: list[bool]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.counted):
            raise ValueError("token_ids and counted must have the same length")


@dataclass(frozen=True)
class PackedData:
    """Rows of packed samples: tokens / segments [N, S] int64, counted [N, S] bool."""

    tokens: torch.Tensor
    segments: torch.Tensor
    counted: torch.Tensor
    description: str

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens[index], self.segments[index], self.counted[index]


# -- sources --------------------------------------------------------------------------
def data_path(data: str | None) -> Path:
    return Path(data).expanduser() if data else default_text_file()


def is_chat_file(path: Path) -> bool:
    return path.suffix.lower() == CHAT_SUFFIX


def check_data_source(data: str | None) -> Path:
    """Fail early (before a model loads) on a missing or unusable data file."""
    path = data_path(data)
    if not path.is_file():
        raise ConfigError("data", str(path), "must be an existing text or .jsonl chat file")
    if is_chat_file(path):
        read_conversations(path)
    else:
        read_training_text(path)
    return path


def read_training_text(path: Path) -> str:
    """The first ~80% of a text file (kvforge.tools.text_data's split: the rest is held out)."""
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ConfigError("data", str(path), "is empty: there is nothing to train on")
    train = split_train_heldout(text)[0]
    if not train.strip():
        raise ConfigError("data", str(path), "has no text in its training part (the first 80%)")
    return train


def read_conversations(path: Path) -> list[list[dict[str, str]]]:
    """The conversations of a chat JSONL file; each line is {"messages": [{"role", "content"}, ...]}."""
    conversations = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError("data", f"{path}:{number}", f"is not valid JSON: {exc.msg}") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise ConfigError("data", f"{path}:{number}",
                                  'must be {"messages": [{"role": ..., "content": ...}, ...]}')
            conversations.append([{"role": m["role"], "content": m["content"]} for m in messages])
    if not conversations:
        raise ConfigError("data", str(path), "is empty: there is nothing to train on")
    if not any(m["role"] == "assistant" for conv in conversations for m in conv):
        raise ConfigError("data", str(path), "has no assistant turns: chat data trains on assistant "
                                             "tokens only, so there is nothing to train on")
    return conversations


# -- tokenisation ---------------------------------------------------------------------
def text_samples(text: str, tokenizer: Any) -> list[Sample]:
    """One sample per article (split at top-level ' = Title = ' lines); every position counts."""
    starts = [m.start() for m in _ARTICLE_TITLE.finditer(text)]
    if not starts or starts[0] != 0:
        starts = [0] + starts
    bounds = starts + [len(text)]
    samples = []
    for begin, end in zip(bounds, bounds[1:]):
        piece = text[begin:end]
        if piece.strip():
            ids = list(tokenizer.encode(piece))
            if len(ids) >= 2:
                samples.append(Sample(ids, [True] * len(ids)))
    return samples


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns: from the
    end of the generation prompt that precedes a turn to the end of the turn as rendered
    (end-of-turn marker included, since the model must learn to stop)."""
    text = _render(tokenizer, messages, False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], True) if index else ""
        through = _render(tokenizer, messages[:index + 1], False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ConfigError("chat_template", "not prefix-stable",
                              "rendering a conversation must extend the rendering of its first turns "
                              "(needed to find the assistant tokens)")
        spans.append((len(before), len(through)))
    return text, spans


def chat_sample(tokenizer: Any, messages: Sequence[dict[str, str]]) -> Sample:
    text, spans = assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
    in_response = [any(lo <= start < hi for lo, hi in spans) for start, _ in offsets]
    counted = in_response[1:] + [False]  # position t predicts token t + 1
    return Sample(ids, counted)


def chat_samples(conversations: Sequence[Sequence[dict[str, str]]], tokenizer: Any) -> list[Sample]:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data", "chat file", "needs a model whose tokenizer has a chat template")
    return [chat_sample(tokenizer, conv) for conv in conversations]


def chat_prompts(conversations: Sequence[Sequence[dict[str, str]]], tokenizer: Any) -> list[list[int]]:
    """Each conversation up to its first assistant turn, rendered with the generation prompt."""
    prompts = []
    for conv in conversations:
        first = next((i for i, m in enumerate(conv) if m["role"] == "assistant"), len(conv))
        if first:
            text = _render(tokenizer, conv[:first], True)
            prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def text_prompts(samples: Sequence[Sample], count: int, length: int, seed: int,
                 bos: int | None) -> list[list[int]]:
    """`count` prompts of `length` tokens cut at seeded random offsets of the text samples
    (BOS first for models that start every text with it)."""
    usable = [s.token_ids for s in samples if len(s.token_ids) > length]
    if not usable:
        raise ConfigError("self-generate-prompt-tokens", length, "is longer than every text sample")
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ids = rng.choice(usable)
        start = rng.randrange(0, len(ids) - length)
        piece = ids[start:start + length]
        if bos is not None and piece[0] != bos:
            piece = [bos] + piece[:-1]
        prompts.append(piece)
    return prompts


def completion_sample(prompt: Sequence[int], completion: Sequence[int]) -> Sample:
    ids = list(prompt) + list(completion)
    first = len(prompt) - 1  # the prompt's last position predicts the first completion token
    return Sample(ids, [first <= t < len(ids) - 1 for t in range(len(ids))])


# -- packing --------------------------------------------------------------------------
def pack(samples: Sequence[Sample], seq_len: int, pad_id: int, split: bool, description: str = "") -> PackedData:
    """Rows of `seq_len` tokens. `split`: samples flow across rows (a continuation starts a new
    segment at position 0); otherwise each sample stays in one row (truncated to a row)."""
    rows: list[tuple[list[int], list[int], list[bool]]] = []
    tokens: list[int] = []
    segments: list[int] = []
    counted: list[bool] = []
    segment = 0

    def close_row() -> None:
        nonlocal tokens, segments, counted, segment
        if not tokens:
            return
        pad = seq_len - len(tokens)
        rows.append((tokens + [pad_id] * pad, segments + [segment] * pad, counted + [False] * pad))
        tokens, segments, counted, segment = [], [], [], 0

    for sample in samples:
        if not any(sample.counted):
            continue
        ids, marks = sample.token_ids, sample.counted
        if not split:
            ids, marks = ids[:seq_len], marks[:seq_len]
            if len(tokens) + len(ids) > seq_len:
                close_row()
        while ids:
            take = min(len(ids), seq_len - len(tokens))
            tokens += ids[:take]
            counted += marks[:take]
            segments += [segment] * take
            segment += 1
            ids, marks = ids[take:], marks[take:]
            if len(tokens) == seq_len:
                close_row()
    close_row()
    if not rows:
        raise ConfigError("data", description or "samples", "produced no training tokens")
    return PackedData(torch.tensor([r[0] for r in rows], dtype=torch.long),
                      torch.tensor([r[1] for r in rows], dtype=torch.long),
                      torch.tensor([r[2] for r in rows], dtype=torch.bool), description)
