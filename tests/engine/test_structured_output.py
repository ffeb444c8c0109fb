"""Structured output on the engine: every constrained request's text is one the constraint
accepts (a choice, a regex, a JSON schema, any JSON object), whatever the sampling; the
mask at each step is exactly the set of ids that keep the text a prefix of an accepted one;
unconstrained requests in the same batch are untouched; bad constraints fail before the
request is queued, naming the field; a request whose matcher can go no further ends alone.

The model is a tiny random Llama over a byte-fallback tokenizer (tests/grammar_helpers.py):
its choices are noise, so only the constraint keeps the text in shape."""

from __future__ import annotations

import json
import re

import pytest
import torch
from grammar_helpers import WORDS, byte_model_fixture, byte_tokenizer  # noqa: F401 - fixture
from server_helpers import make_engine

from kvforge.engine import grammar_matcher, llm_engine
from kvforge.engine.grammar_matcher import GrammarCompiler, allowed_masks
from kvforge.engine.sampling import SamplingParams
from kvforge.engine.structured_output import StructuredOutputs, lark_literal
from kvforge.errors import ConfigError

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "yes", "no"]}, "c": {"type": "boolean"}},
          "required": ["a", "b", "c"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def run(model, tokenizer, requests: list[SamplingParams], prompt: str = "hello"):
    """The final output of each request, all in one engine."""
    engine = make_engine(model, tokenizer)
    ids = [engine.add_request(tokenizer.encode(prompt), params) for params in requests]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


def sampled(constraint: StructuredOutputs, seeds=range(6), max_tokens: int = 48) -> list[SamplingParams]:
    """Hot sampling (where the model alone would wander anywhere), one request per seed."""
    return [SamplingParams(max_tokens=max_tokens, temperature=1.5, seed=seed, structured_outputs=constraint)
            for seed in seeds]


def test_a_choice_gives_exactly_one_of_the_strings(model, tokenizer):
    choices = ("yes", "no", "yellow", "maybe so")
    outputs = run(model, tokenizer, sampled(StructuredOutputs(choice=choices), range(12)))
    assert all(out.text in choices and out.finish_reason == "stop" for out in outputs), [o.text for o in outputs]
    assert len({out.text for out in outputs}) > 1  # the model still chooses among them
    # the request ends with the choice's last token (nothing may follow it), not an EOS after it
    assert all(out.token_ids[-1] != tokenizer.eos_token_id for out in outputs)


def test_a_regex_is_matched_in_full(model, tokenizer):
    pattern = r"[0-9]{3}-[a-z]{2}"
    outputs = run(model, tokenizer, sampled(StructuredOutputs(regex=pattern)))
    for out in outputs:
        assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out.text


def test_an_open_ended_regex_ends_with_eos_or_the_length(model, tokenizer):
    outputs = run(model, tokenizer, sampled(StructuredOutputs(regex=r"[0-9]+"), max_tokens=6))
    for out in outputs:
        assert out.text.isdigit(), out.text
        assert out.finish_reason == "length" or out.token_ids[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("compact", [True, False])
def test_json_of_a_schema_parses_and_follows_it(model, tokenizer, compact):
    constraint = StructuredOutputs(json=SCHEMA, disable_any_whitespace=compact)
    outputs = run(model, tokenizer, sampled(constraint, max_tokens=120))
    finished = [out for out in outputs if out.finish_reason == "stop"]
    assert len(finished) >= len(outputs) // 2  # (flexible whitespace may run to the length)
    for out in finished:
        value = json.loads(out.text)
        assert set(value) == {"a", "b", "c"} and 0 <= value["a"] <= 99 and value["b"] in ("x", "yes", "no")
        assert isinstance(value["c"], bool)
        if compact:
            assert " " not in out.text and "\n" not in out.text
    for out in outputs:  # cut or not, the text is a prefix of an accepted one
        assert out.text.startswith("{") or out.text.lstrip().startswith("{")


def test_json_object_mode_gives_an_object(model, tokenizer):
    outputs = run(model, tokenizer, sampled(StructuredOutputs(json_object=True, disable_any_whitespace=True),
                                            max_tokens=160))
    parsed = [json.loads(out.text) for out in outputs if out.finish_reason == "stop"]
    assert parsed and all(isinstance(value, dict) for value in parsed)


def test_greedy_requests_are_constrained_too(model, tokenizer):
    (out,) = run(model, tokenizer, [SamplingParams.greedy_params(16, structured_outputs=StructuredOutputs(
        choice=("maybe so", "no")))])
    assert out.text in ("maybe so", "no") and out.finish_reason == "stop"


def test_the_mask_is_the_set_of_ids_that_keep_the_text_a_prefix_of_a_choice(tokenizer):
    """The definition, checked id by id: after each prefix of a choice, id t is allowed iff
    the text plus t's text is a prefix of some choice (or t is EOS and the text is one),
    give or take byte-fallback tokens (3-258)."""
    choices = ("yes", "yellow", "no 1")
    compiler = GrammarCompiler(tokenizer, 320, frozenset({2}))
    texts = {t: token_text(tokenizer.convert_ids_to_tokens(t)) for t in range(3, len(tokenizer))}  # (0-2: specials)
    for choice in choices:
        for cut in range(len(choice) + 1):
            matcher = compiler.matcher(StructuredOutputs(choice=choices))
            for token in tokenizer.encode(choice[:cut], add_special_tokens=False)[1:] if cut else []:
                assert matcher.consume_token(token)  # (the first id is the leading-space marker)
            text = choice[:cut]
            expected = {t for t, piece in texts.items() if piece and any(c.startswith(text + piece) for c in choices)}
            if text in choices:
                expected.add(2)
            masks, broken = allowed_masks([matcher], 320)
            assert not broken
            allowed = set(masks[0].nonzero().flatten().tolist())
            # llguidance may leave out a byte-fallback token where a whole token says the same
            assert allowed <= expected and expected - allowed <= BYTE_TOKENS, (text, expected ^ allowed)


BYTE_TOKENS = set(range(3, 259))


def token_text(token: str) -> str:
    """The text a token of byte_tokenizer stands for: a byte token's byte (ASCII here, the
    rest never prefix a choice), the leading-space marker as a space."""
    if re.fullmatch(r"<0x[0-9A-F]{2}>", token):
        return chr(int(token[3:5], 16)) if int(token[3:5], 16) < 128 else "\ufffd"
    return token.replace("▁", " ")


def test_masks_of_a_batch_are_each_matchers_own(tokenizer):
    """Several matchers in different states, unpacked together: each row is that matcher's
    mask alone; a broken matcher's row allows nothing and is reported by its row."""
    compiler = GrammarCompiler(tokenizer, 320, frozenset({2}))
    matchers = [compiler.matcher(StructuredOutputs(choice=("yes", "no 1"))) for _ in range(3)]
    matchers.append(compiler.matcher(StructuredOutputs(regex="[0-9]+")))
    for token in tokenizer.encode("ye", add_special_tokens=False)[1:]:
        assert matchers[1].consume_token(token)
    assert not matchers[2].consume_token(tokenizer.convert_tokens_to_ids("5"))  # now in error
    masks, broken = allowed_masks(matchers, 320)
    assert [row for row, _ in broken] == [2] and not masks[2].any()
    for row in (0, 1, 3):  # against the bitmask read bit by bit: bit b of 32-bit word w is id 32w + b
        words = [int.from_bytes(matchers[row].compute_bitmask()[4 * w:4 * w + 4], "little") for w in range(10)]
        assert masks[row].tolist() == [bool(words[i // 32] >> (i % 32) & 1) for i in range(320)]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[3])

    class AllowsNothing:  # (llguidance itself gives a matcher in error an EOS-only mask instead)
        def is_error(self) -> bool:
            return False

        def compute_bitmask(self) -> bytes:
            return bytes(len(matchers[0].compute_bitmask()))

    masks, broken = allowed_masks([matchers[0], AllowsNothing()], 320)
    assert broken == [(1, "the structured-output constraint allows no token here")] and masks[0].any()


def test_requests_sharing_a_constraint_parse_it_once(tokenizer, monkeypatch):
    """A matcher per request is a copy of one pristine matcher per grammar (the n choices of
    a request share their constraint); the copies are independent (the test above)."""
    import llguidance

    built = []
    real = llguidance.LLMatcher

    class Counting:  # LLMatcher, its constructions counted (its class cannot be subclassed)
        def __call__(self, *args, **kwargs):
            built.append(args[1])
            return real(*args, **kwargs)

        def __getattr__(self, name: str):
            return getattr(real, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    compiler = GrammarCompiler(tokenizer, 320, frozenset({2}))
    first = [compiler.matcher(StructuredOutputs(choice=("yes", "no"))) for _ in range(4)]
    compiler.matcher(StructuredOutputs(regex="[0-9]+"))
    assert len(built) == 2 and len({id(m) for m in first}) == 4


def test_the_grammars_used_last_are_kept(tokenizer, monkeypatch):
    """Both caches forget the grammar used least recently: a schema every request sends stays
    however many one-off ones pass."""
    monkeypatch.setattr(grammar_matcher, "CHECKED_KEPT", 3)
    compiler = GrammarCompiler(tokenizer, 320, frozenset({2}))
    hot = StructuredOutputs(choice=("yes", "no"))
    compiler.matcher(hot)
    for digits in range(1, 6):  # one-off grammars, the hot one used between each
        compiler.matcher(StructuredOutputs(regex=f"[0-9]{{{digits}}}"))
        compiler.matcher(hot)
    kept = [key[0] for key in compiler._checked]
    assert kept == [StructuredOutputs(regex="[0-9]{4}"), StructuredOutputs(regex="[0-9]{5}"), hot], kept
    assert len(compiler._pristine) == 3 and compiler.check(hot) in compiler._pristine


def test_unconstrained_requests_in_the_batch_are_untouched(model, tokenizer):
    free = [SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True),
            SamplingParams.greedy_params(12, ignore_eos=True)]
    alone = run(model, tokenizer, free)
    together = run(model, tokenizer, [free[0], *sampled(StructuredOutputs(regex=r"[a-z]+"), range(2)), free[1]])
    assert [o.token_ids for o in alone] == [together[0].token_ids, together[-1].token_ids]


def run_two(engine, constrained: str, free: str, before_step=None) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        if before_step is not None:
            before_step(engine.steps)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final[free].finish_reason == "length" and len(final[free].token_ids) == 6  # the other goes on
    return final[constrained]


def add_two(engine, tokenizer, **constrained_params) -> tuple[str, str]:
    constrained = engine.add_request(tokenizer.encode("hi"), SamplingParams(
        max_tokens=10, temperature=1.0, seed=1, ignore_eos=True, structured_outputs=StructuredOutputs(regex="[a-z]+"),
        **constrained_params))
    free = engine.add_request(tokenizer.encode("hi"), SamplingParams.greedy_params(6, ignore_eos=True))
    return constrained, free


def test_a_request_whose_matcher_falls_into_error_ends_alone(model, tokenizer):
    """A matcher in error (a parser limit, say) would allow only EOS, and the request would
    end as if complete: it ends with an error instead. The matcher is put in error for real,
    by feeding it a digit after the first two steps."""
    engine = make_engine(model, tokenizer)
    constrained, free = add_two(engine, tokenizer)
    matcher = engine._requests[constrained].grammar
    digit = tokenizer.convert_tokens_to_ids("5")

    def break_it(steps: int) -> None:
        if steps == 2:
            assert not matcher.consume_token(digit) and matcher.is_error()

    out = run_two(engine, constrained, free, break_it)
    assert out.finish_reason == "error" and len(out.token_ids) == 2 and "constraint failed" in out.error


def test_a_token_the_matcher_refuses_ends_that_request_alone(model, tokenizer, monkeypatch):
    """Were a token outside the mask ever chosen (here the mask is made to allow every id,
    and a bias forces a digit), the matcher refuses it and that request ends with an error."""
    monkeypatch.setattr(llm_engine, "allowed_masks",
                        lambda matchers, vocab: (torch.ones(len(matchers), vocab, dtype=torch.bool), []))
    engine = make_engine(model, tokenizer)
    digit = tokenizer.convert_tokens_to_ids("5")
    constrained, free = add_two(engine, tokenizer, logit_bias={digit: 100})
    out = run_two(engine, constrained, free)
    assert out.finish_reason == "error" and out.token_ids == [digit] and "broke" in out.error


@pytest.mark.parametrize(("constraint", "parameter"), [
    (dict(regex="("), "structured_outputs.regex"),
    (dict(grammar="start: foo"), "structured_outputs.grammar"),
    (dict(grammar="root ::= (("), "structured_outputs.grammar"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 2}), "structured_outputs.json"),
])
def test_a_constraint_that_does_not_compile_fails_before_it_is_queued(model, tokenizer, constraint, parameter):
    engine = make_engine(model, tokenizer)
    with pytest.raises(ConfigError) as caught:
        engine.add_request(tokenizer.encode("hi"), SamplingParams(structured_outputs=StructuredOutputs(**constraint)))
    assert caught.value.parameter == parameter
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(("fields", "parameter"), [
    (dict(), "structured_outputs"),
    (dict(regex="a", choice=["a"]), "structured_outputs"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json="[1, 2]"), "structured_outputs.json"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", ""]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(json_object=1), "structured_outputs.json_object"),
    (dict(json_object=True, disable_any_whitespace="yes"), "structured_outputs.disable_any_whitespace"),
    (dict(regex="a\ud800"), "structured_outputs.regex"),  # lone surrogates: not text any grammar can hold
    (dict(choice=["ok", "\udfff"]), "structured_outputs.choice"),
    (dict(json={"const": "\ud800"}), "structured_outputs.json"),
])
def test_a_malformed_constraint_names_its_field(fields, parameter):
    with pytest.raises(ConfigError) as caught:
        StructuredOutputs(**fields)
    assert caught.value.parameter == parameter
    if "\ud800" in str(fields) or "\udfff" in str(fields):
        assert "Unicode" in caught.value.rule


def test_rules_that_would_ban_the_constraints_ids_are_refused():
    constraint = StructuredOutputs(json_object=True)
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=constraint)
    with pytest.raises(ConfigError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[5], structured_outputs=constraint)


def test_without_a_tokenizer_or_the_package_the_error_says_what_is_missing(model, tokenizer, monkeypatch):
    engine = make_engine(model, None)
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        engine.add_request([5, 6], SamplingParams(structured_outputs=StructuredOutputs(regex="a")))
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)
    engine = make_engine(model, tokenizer)
    with pytest.raises(ConfigError, match="pip install"):
        engine.add_request([5, 6], SamplingParams(structured_outputs=StructuredOutputs(regex="a")))


def test_a_choice_literal_matches_exactly_its_text(tokenizer):
    """Quotes, backslashes, newlines and non-ASCII characters are literal in a choice."""
    odd = ('say "hi"', "back\\slash", "two\nlines", "été ☃", "del\x7f", "emoji 😀")
    compiler = GrammarCompiler(tokenizer, 320, frozenset({2}))
    for choice in odd:
        matcher = compiler.matcher(StructuredOutputs(choice=odd))
        ids = tokenizer.encode(choice, add_special_tokens=False)[1:]
        assert matcher.consume_tokens(ids) and matcher.is_stopped(), (choice, lark_literal(choice))
    assert set(WORDS) >= {"yes", "no"}


def test_stop_token_ids_still_end_a_constrained_request(model, tokenizer):
    """A stop id the constraint allows ends the request where the free constrained run
    would have produced it, without its text."""
    constraint = StructuredOutputs(regex="[a-f]{12}")
    (free,) = run(model, tokenizer, sampled(constraint, [4]))
    stop = free.token_ids[3]
    (stopped,) = run(model, tokenizer, [SamplingParams(max_tokens=48, temperature=1.5, seed=4, stop_token_ids=[stop],
                                                      structured_outputs=constraint)])
    cut = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[:cut + 1] and stopped.finish_reason == "stop"
    assert stopped.text == tokenizer.decode(free.token_ids[:cut])
