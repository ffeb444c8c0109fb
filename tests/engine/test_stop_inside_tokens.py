"""Stop strings that start or end inside a token of several characters: the text is cut
at the stop string's first character even when that falls mid-token, the token that
completed the stop is the last one kept, and no delta ever shows text past the cut.

tests/engine/test_stream_text.py checks the same rules with one character per token; here
the tokenizer has whole words, and `allowed_token_ids` keeps the tiny model to them, so
every generated token is a word of 2-8 characters (with its leading space)."""

from __future__ import annotations

import random

import pytest
import transformers
from server_helpers import make_engine, model_fixture  # noqa: F401 - fixture
from test_stream_text import check_deltas, cut_at_first_stop
from tokenizers import Tokenizer, decoders, models, normalizers

from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling import SamplingParams

WORDS = ["▁", *"abcxyz", "▁Paris", "▁is", "▁the", "▁capital", "▁of", "▁France", "▁Parisian", "▁island"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """<unk>=0, <s>=1, </s>=2, then WORDS (Llama's leading-space marker, stripped at the start)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in WORDS:
        vocab[word] = len(vocab)
    model = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


def word_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.convert_tokens_to_ids(w) for w in WORDS if w.startswith("▁") and len(w) > 2)


def generate(model, tokenizer, params: SamplingParams, prompt: str = "x y z") -> list[RequestOutput]:
    engine = make_engine(model, tokenizer)
    engine.add_request(tokenizer.encode(prompt), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, in order."""
    texts = [tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(len(ids) + 1)]
    return [b[len(a):] for a, b in zip(texts, texts[1:])]


@pytest.fixture(scope="module")
def free_run(model, tokenizer) -> RequestOutput:
    params = SamplingParams.greedy_params(MAX_TOKENS, ignore_eos=True, allowed_token_ids=word_ids(tokenizer))
    final = check_deltas(generate(model, tokenizer, params))
    assert final.finish_reason == "length" and len(final.token_ids) == MAX_TOKENS
    words = pieces(tokenizer, final.token_ids)
    assert all(len(w) >= 3 for w in words[1:]) and len(words[0]) >= 2, words  # every token a word
    return final


def stopped(model, tokenizer, free_run, stop: str, include: bool = False) -> RequestOutput:
    params = SamplingParams.greedy_params(MAX_TOKENS, ignore_eos=True, allowed_token_ids=word_ids(tokenizer),
                                          stop=[stop], include_stop_str_in_output=include)
    return check_deltas(generate(model, tokenizer, params))


def test_a_stop_string_inside_one_token_cuts_that_token_in_the_middle(model, tokenizer, free_run):
    words = pieces(tokenizer, free_run.token_ids)
    index = next(i for i in range(1, len(words)) if words[i] not in "".join(words[:i]))  # a new word
    start = len("".join(words[:index])) + 2  # past its space and first letter
    stop = free_run.text[start:start + 2]
    assert free_run.text.find(stop) == start, "the test needs a stop string that first occurs there"
    final = stopped(model, tokenizer, free_run, stop)
    assert final.text == free_run.text[:start] and final.finish_reason == "stop"
    assert final.token_ids == free_run.token_ids[:index + 1]
    kept = stopped(model, tokenizer, free_run, stop, include=True)
    assert kept.text == free_run.text[:start + 2] and kept.token_ids == final.token_ids


def test_a_stop_string_from_one_token_into_the_middle_of_the_next(model, tokenizer, free_run):
    words = pieces(tokenizer, free_run.token_ids)
    for index in range(1, len(words) - 1):
        boundary = len("".join(words[:index + 1]))
        stop = free_run.text[boundary - 2:boundary + 3]  # two letters, the space, two letters
        if free_run.text.find(stop) == boundary - 2:
            break
    else:
        pytest.fail("no stop string of this shape occurs first at a token boundary")
    final = stopped(model, tokenizer, free_run, stop)
    assert final.text == free_run.text[:boundary - 2] and final.finish_reason == "stop"
    assert final.token_ids == free_run.token_ids[:index + 2]


@pytest.mark.parametrize("seed", range(4))
def test_random_stop_strings_cut_where_they_first_complete(model, tokenizer, free_run, seed):
    """Stops of 1-6 characters taken anywhere in the free text (so most start or end inside
    a word), kept or cut: the text is the free text up to the first completed stop's start
    (plus that stop when kept), and the tokens end with the one that completed it."""
    rng = random.Random(seed)
    text, words = free_run.text, pieces(tokenizer, free_run.token_ids)
    for _ in range(4):
        stops = []
        for _ in range(rng.randint(1, 3)):
            length = rng.randint(1, 6)
            begin = rng.randrange(len(text) - length)
            stops.append(text[begin:begin + length])
        include = rng.random() < 0.5
        params = SamplingParams.greedy_params(MAX_TOKENS, ignore_eos=True, allowed_token_ids=word_ids(tokenizer),
                                              stop=stops, include_stop_str_in_output=include)
        final = check_deltas(generate(model, tokenizer, params))
        cut, count = cut_at_first_stop(words, stops)
        kept = next(s for s in stops if "".join(words[:count]).find(s) == len(cut)) if include else ""
        assert (final.text, final.token_ids) == (cut + kept, free_run.token_ids[:count]), (stops, include)
        assert final.finish_reason == "stop"
