"""vLLM's bad_words: the token sequences a word stands for (alone, and with a leading space
when that makes another first token of the same count), the ids banned after an output
(a one-token word always, a longer one when the output ends with the rest of it), and the
engine's output never completing a bad word, while a word begun in the prompt is not
followed (vLLM reads the output only)."""

from __future__ import annotations

import pytest
from server_helpers import make_engine, model_fixture, tokenizer_fixture  # noqa: F401 - fixtures

from kvforge.engine.bad_words import bad_word_sequences, banned_by_bad_words
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError


class WordTokenizer:
    """encode() from a table: what a word and its spaced form tokenize to."""

    TABLE = {"the": [10], " the": [11], "ban": [1, 2], " ban": [3, 2], "x": [5], " x": [6, 5],
             "same": [7, 8], " same": [7, 8], "zero": [], " zero": []}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.TABLE[text]


def test_a_word_stands_for_its_own_tokens_and_a_spaced_form_of_the_same_length():
    assert bad_word_sequences(WordTokenizer(), ["the"]) == ((10,), (11,))
    assert bad_word_sequences(WordTokenizer(), [" ban"]) == ((1, 2), (3, 2))  # the word's own space is dropped
    assert bad_word_sequences(WordTokenizer(), ["x"]) == ((5,),)  # " x" is two tokens: not a word-initial form
    assert bad_word_sequences(WordTokenizer(), ["same"]) == ((7, 8),)  # the same first token: once


def test_a_word_of_no_tokens_or_without_a_tokenizer_is_refused():
    with pytest.raises(ConfigError, match="at least one token"):
        bad_word_sequences(WordTokenizer(), ["zero"])
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        bad_word_sequences(None, ["the"])


@pytest.mark.parametrize(("output", "banned"), [
    ([], {10, 11}),  # one-token words always; a longer word needs its prefix in the output
    ([1], {10, 11, 2}), ([4, 3], {10, 11, 2}), ([1, 2], {10, 11}), ([2], {10, 11}),
])
def test_the_last_token_of_a_word_is_banned_once_the_output_ends_with_the_rest(output, banned):
    sequences = bad_word_sequences(WordTokenizer(), ["the", "ban"])
    assert banned_by_bad_words(sequences, output) == banned


def generate(model, tokenizer, prompt: str, **params) -> str:
    engine = make_engine(model, tokenizer)
    engine.add_request(tokenizer.encode(prompt), SamplingParams.greedy_params(24, ignore_eos=True, **params))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs[-1].text


def test_the_output_never_completes_a_bad_word(model, tokenizer):
    free = generate(model, tokenizer, "xyz")
    words = [free[4:6], free[9:12], free[1]]  # the character tokenizer: one token per character
    banned = generate(model, tokenizer, "xyz", bad_words=words)
    assert banned != free and not any(word in banned for word in words), (free, banned, words)
    first_ban = min(free.find(word) + len(word) - 1 for word in words)  # where the free text first completes one
    assert banned[:first_ban] == free[:first_ban]  # (greedy: the same text until a ban bites)


def test_a_word_begun_in_the_prompt_is_not_followed(model, tokenizer):
    free = generate(model, tokenizer, "xyz")
    word = "z" + free[0]  # its first character ends the prompt, its second starts the output
    assert generate(model, tokenizer, "xyz", bad_words=[word])[0] == free[0]


@pytest.mark.parametrize(("fields", "parameter"), [
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words=["  "]), "bad_words"), (dict(bad_words=[3]), "bad_words"),
    (dict(bad_words=[f"w{i}" for i in range(129)]), "bad_words"),
    (dict(bad_words=["a"], allowed_token_ids=[5, 6]), "bad_words"),
])
def test_bad_word_lists_that_cannot_work_are_refused(fields, parameter):
    with pytest.raises(ConfigError) as caught:
        SamplingParams(**fields)
    assert caught.value.parameter == parameter
