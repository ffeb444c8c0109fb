"""Distillation data: packing with segments, loss masks of chat and generated samples."""

from __future__ import annotations

import json

import pytest
import torch
from distill_helpers import one_thread, random_samples  # noqa: F401

from kvforge.errors import ConfigError
from kvforge.models.dense import segment_positions
from kvforge.tools.swiftkv.data import (
    Sample,
    chat_sample,
    completion_sample,
    pack,
    read_conversations,
    text_samples,
)


def test_split_packing_fills_rows_and_restarts_positions_at_each_sample():
    samples = random_samples(9, seed=1)
    data = pack(samples, 16, pad_id=0, split=True)
    flat = torch.cat([data.tokens[r] for r in range(data.num_rows)]).tolist()
    stream = [t for s in samples for t in s.token_ids]
    assert flat[:len(stream)] == stream  # every token, in order; only the last row is padded
    assert not data.counted.reshape(-1)[len(stream):].any()
    positions = segment_positions(data.segments)
    starts, offset = [], 0
    for s in samples:  # a sample starts at position 0, and again where it continues in a new row
        starts.append(offset)
        offset += len(s.token_ids)
    for index in starts:
        assert positions.reshape(-1)[index] == 0
    assert int((positions == 0).sum()) <= len(samples) + data.num_rows + 1


def test_whole_sample_packing_keeps_samples_in_one_row_and_never_counts_padding():
    samples = random_samples(9, seed=2, chat_like=True) + [Sample(list(range(1, 41)), [True] * 40)]
    data = pack(samples, 24, pad_id=0, split=False)
    rows = [(data.tokens[r].tolist(), data.segments[r].tolist(), data.counted[r].tolist()) for r in range(data.num_rows)]
    found = []
    for tokens, segments, counted in rows:
        for segment in sorted(set(segments)):
            idx = [i for i, s in enumerate(segments) if s == segment]
            assert idx == list(range(idx[0], idx[-1] + 1))
            found.append(([tokens[i] for i in idx], [counted[i] for i in idx]))
    for sample in samples:
        ids, marks = sample.token_ids[:24], sample.counted[:24]  # the long one is truncated
        assert (ids, marks) in found
    real = sum(len(s.token_ids[:24]) for s in samples)
    assert int(data.counted.sum()) == sum(sum(s.counted[:24]) for s in samples)
    assert data.num_rows * 24 - real == sum(1 for ids, marks in found if not any(marks) for _ in ids)


def test_samples_without_counted_positions_are_dropped_and_nothing_left_is_an_error():
    with pytest.raises(ConfigError, match="no training tokens"):
        pack([Sample([1, 2, 3], [False] * 3)], 8, 0, split=False)


def test_completion_samples_count_the_predictions_of_completion_tokens():
    sample = completion_sample([5, 6, 7], [8, 9])
    assert sample.token_ids == [5, 6, 7, 8, 9]
    assert sample.counted == [False, False, True, True, False]


class CharTokenizer:
    def encode(self, text):
        return [ord(c) % 50 for c in text]


def test_text_is_split_into_articles():
    text = " = First = \nalpha beta\n = = Section = = \ngamma\n = Second = \ndelta epsilon\n"
    samples = text_samples(text, CharTokenizer())
    assert len(samples) == 2
    assert sum(len(s.token_ids) for s in samples) == len(text)
    assert all(all(s.counted) for s in samples)


@pytest.fixture(scope="module")
def chat_tokenizer():
    from kvforge.models.loader import resolve_model_source
    from kvforge.models.tokenizer import load_tokenizer

    try:
        return load_tokenizer(resolve_model_source("smollm2-135m"))
    except Exception as exc:  # the named model is an optional local install
        pytest.skip(f"smollm2-135m tokenizer unavailable: {exc}")


def test_chat_samples_count_exactly_the_assistant_tokens(chat_tokenizer):
    messages = [{"role": "user", "content": "What is two plus two?"},
                {"role": "assistant", "content": "Four, of course."},
                {"role": "user", "content": "And three times three?"},
                {"role": "assistant", "content": "Nine."}]
    sample = chat_sample(chat_tokenizer, messages)
    ids = sample.token_ids
    predicted = [ids[t + 1] for t in range(len(ids) - 1) if sample.counted[t]]
    text = chat_tokenizer.decode(predicted)
    end = chat_tokenizer.decode(chat_tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"])
    assert text.replace("\n", "") == f"Four, of course.{end}Nine.{end}"
    assert not sample.counted[-1]


def test_chat_file_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{not json}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2.*not valid JSON"):
        read_conversations(bad)
    shape = tmp_path / "shape.jsonl"
    shape.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ConfigError, match="messages"):
        read_conversations(shape)
