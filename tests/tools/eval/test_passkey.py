"""Pass-key samples (deterministic, exact lengths, needle placement) and the scorer."""

from __future__ import annotations

import pytest
from tiny_eval import CharTokenizer

from kvforge.errors import ConfigError
from kvforge.tools.eval.passkey import (
    ANSWER_PREFIX,
    INSTRUCTION,
    NOISE_SENTENCES,
    QUESTION,
    build_grid,
    build_sample,
    check_key_fits,
    depth_grid,
    make_key,
    score_output,
    split_sentences,
)


def test_depth_grid_hand_cases():
    assert depth_grid(1) == [0.5]
    assert depth_grid(2) == [0.0, 1.0]
    assert depth_grid(5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ConfigError):
        depth_grid(0)


def test_keys_are_deterministic_and_have_the_digits():
    keys = {make_key(0, 2048, d, 0) for d in range(10)}
    assert keys == {make_key(0, 2048, d, 0) for d in range(10)}
    assert len(keys) > 1 and all(len(k) == 5 and k.isdigit() and k[0] != "0" for k in keys)
    assert make_key(1, 2048, 3, 0) != make_key(0, 2048, 3, 0)
    assert len(make_key(0, 10, 0, 0, digits=8)) == 8


@pytest.mark.parametrize("output,correct", [
    (" The pass key is 12345.", True), ("12345", True), ("key: 12345!", True), ("12345 is it", True),
    ("123456", False), ("012345", False), ("1234", False), ("12 345", False), ("", False)])
def test_score_output_hand_cases(output: str, correct: bool):
    assert score_output("12345", output) is correct


def test_split_sentences():
    assert split_sentences("A b.  C d!\nE?  F") == ["A b.", "C d!", "E?", "F"]


@pytest.mark.parametrize("length", [400, 457, 900])
def test_sample_fills_to_length_and_places_the_needle(length: int):
    tokenizer = CharTokenizer(add_bos=True)
    # one more sentence (and its space, one token per character) would not have fitted
    longest = max(len(s) for s in NOISE_SENTENCES) + 1
    for depth in (0.0, 0.5, 1.0):
        sample = build_sample(tokenizer, length, depth, "54321", NOISE_SENTENCES)
        assert length - longest < sample.prompt_tokens <= length
        assert sample.token_ids[0] == tokenizer.bos_token_id
        text = tokenizer.decode(sample.token_ids)
        assert text.startswith(INSTRUCTION) and text.endswith(QUESTION + ANSWER_PREFIX)
        needle = "The pass key is 54321. Remember it. 54321 is the pass key."
        before, after = text[len(INSTRUCTION):text.index(QUESTION)].split(needle)
        # the needle sits at the sentence boundary closest to `depth` of the haystack sentences
        count_before, count_after = before.count("."), after.count(".")
        assert count_before == round(depth * (count_before + count_after))
        assert count_before + count_after > 3


def test_grid_is_deterministic_for_a_seed():
    tokenizer = CharTokenizer()
    first = build_grid(tokenizer, [350, 500], 3, seed=7, sentences=NOISE_SENTENCES)
    again = build_grid(tokenizer, [350, 500], 3, seed=7, sentences=NOISE_SENTENCES)
    other = build_grid(tokenizer, [350, 500], 3, seed=8, sentences=NOISE_SENTENCES)
    assert first == again
    assert [s.key for s in first] != [s.key for s in other]
    assert [(s.length, s.depth_index) for s in first] == [(n, d) for n in (350, 500) for d in range(3)]


def test_too_short_length_fails_clearly():
    with pytest.raises(ConfigError, match="without any filler"):
        build_sample(CharTokenizer(), 50, 0.5, "12345", NOISE_SENTENCES)


def test_a_key_longer_than_the_generation_budget_is_refused():
    """Char tokenizer: a 7-digit key is 7 tokens. Every sample of a run whose
    --max-new-tokens is shorter would score 0% whatever the cache, so it is refused."""
    keys = [make_key(0, 64, d, 0) for d in range(3)] + ["1234567"]
    check_key_fits(CharTokenizer(), keys, 7)
    with pytest.raises(ConfigError, match=r"max_new_tokens=6.*pass key's 7 tokens \(7 digits"):
        check_key_fits(CharTokenizer(), keys, 6)
