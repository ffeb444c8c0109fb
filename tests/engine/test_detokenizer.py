"""Incremental detokenising equals one-shot decoding: with a Llama-style tokenizer (a
leading-space marker that decoding strips, byte-fallback tokens for characters outside the
vocabulary), text that spans tokens byte by byte (é, €, an emoji) and special tokens."""

from __future__ import annotations

import random

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers

from kvforge.engine.detokenizer import IncrementalDetokenizer

WORDS = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁the", "▁cat", "▁sat", "é"]


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """<unk>=0, <s>=1, </s>=2, then the 256 byte tokens <0x00>..<0xFF>, then WORDS.
    Decoding turns "▁" into a space, joins byte tokens into UTF-8 (one "\ufffd" per byte
    of an incomplete or invalid sequence) and strips the text's first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in WORDS:
        vocab[word] = len(vocab)
    model = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


def pieces_of(tokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(token) for token in ids]
    assert detokenizer.text == "".join(pieces)
    return pieces


def test_multi_byte_characters_are_held_until_their_last_byte(tokenizer):
    text = "the cat é sat €😀 on"
    ids = tokenizer.encode(text, add_special_tokens=False)
    byte_tokens = [t for t in ids if 3 <= t < 259]
    assert len(byte_tokens) == 7  # € is three byte tokens, 😀 four
    pieces = pieces_of(tokenizer, ids)
    assert "".join(pieces) == text == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)
    euro = ids.index(tokenizer.convert_tokens_to_ids("<0xE2>"))
    assert pieces[euro:euro + 3] == ["", "", "€"]


def test_a_run_of_multi_byte_characters_streams_whole_characters(tokenizer):
    """Chinese or emoji with byte fallback: many byte tokens in a row. The decoding window
    must start on a character boundary, or the decoder marks the whole run broken."""
    text = "the 中文字节 cat 😀😀😀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = pieces_of(tokenizer, ids)
    assert "".join(pieces) == text
    assert [p for p in pieces if p and not p.isascii()] == [*"中文字节", "😀", "😀", "😀"]


def test_a_word_after_the_first_keeps_its_leading_space(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(["▁the", "▁cat", "▁sat"])
    assert pieces_of(tokenizer, ids) == ["the", " cat", " sat"]


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(["<s>", "▁the", "</s>", "▁cat"])
    assert "".join(pieces_of(tokenizer, ids)) == "the cat" == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_is_one_shot_decoding_of_every_prefix(tokenizer, seed):
    """Random ids (words, multi-byte characters byte by byte, broken bytes, special
    tokens): after each id whose one-shot decoding does not end in an incomplete character,
    the pieces so far are that decoding. (While a character is incomplete, decoding marks
    the whole run of byte tokens it ends as broken, so there is nothing to compare with.)"""
    rng = random.Random(seed)
    words = tokenizer.convert_tokens_to_ids(WORDS)
    multi_byte = [list(c.encode()) for c in "é€😀ß中"]
    ids: list[int] = []
    while len(ids) < 80:
        kind = rng.random()
        if kind < 0.5:
            ids.append(rng.choice(words))
        elif kind < 0.8:
            ids.extend(3 + b for b in rng.choice(multi_byte))
        elif kind < 0.9 and (not ids or ids[-1] in words):
            # A byte that no character completes, first in its run of byte tokens: one-shot
            # decoding turns a whole run with a broken byte into "\ufffd"s, which no stream
            # can match once it has shown the run's earlier characters.
            ids.append(3 + rng.randrange(128, 256))
        else:
            ids.append(rng.choice([1, 2]))
    ids.append(words[-1])
    detokenizer = IncrementalDetokenizer(tokenizer)
    compared = 0
    for count, token in enumerate(ids, 1):
        detokenizer.add(token)
        whole = tokenizer.decode(ids[:count], skip_special_tokens=True)
        if not whole.endswith("\ufffd"):
            assert detokenizer.text == whole, f"after {count} ids"
            compared += 1
    assert compared > len(ids) // 2
    assert "\ufffd" in detokenizer.text  # the broken bytes were there to be handled
