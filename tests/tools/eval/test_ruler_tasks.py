"""RULER-style task generators (deterministic, filled to length, answers present) and the
string-match scorers on hand-made cases."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from tiny_eval import CharTokenizer

from kvforge.errors import ConfigError
from kvforge.tools.eval.ruler_tasks import TASKS, build_sample, make_sources, parse_tasks, score, vocabulary

LENGTH = 1500


@pytest.fixture(scope="module")
def sources():
    return make_sources(None)


@pytest.mark.parametrize("task", list(TASKS))
def test_samples_fill_the_budget_and_hold_their_answers(task, sources):
    tokenizer = CharTokenizer()
    sample = build_sample(task, LENGTH, 0, seed=3, tokenizer=tokenizer, sources=sources)
    budget = LENGTH - sample.max_new_tokens
    assert budget - 120 <= len(sample.token_ids) <= budget  # one filler unit from the limit
    text = tokenizer.decode(sample.token_ids)
    assert sample.references
    if task == "cwe":
        listed = Counter(re.findall(r"\d+\. ([a-z]+)", text))
        assert {w for w, _ in listed.most_common(10)} == set(sample.references)
        assert min(listed[w] for w in sample.references) > max(c for w, c in listed.items()
                                                               if w not in sample.references)
    elif task == "fwe":
        counts = Counter(text.split("occurs.")[1].split("Which 3")[0].split())
        ranked = [counts[w] for w in sample.references]
        assert ranked == sorted(ranked, reverse=True)
        assert ranked[-1] >= max(c for w, c in counts.items() if w not in sample.references)
    else:
        for reference in sample.references:
            assert reference in text, (task, reference)


@pytest.mark.parametrize("task", ["niah_multikey_2", "vt", "fwe"])
def test_generation_is_deterministic_for_a_seed(task, sources):
    tokenizer = CharTokenizer()
    first = build_sample(task, 600, 2, seed=5, tokenizer=tokenizer, sources=sources)
    again = build_sample(task, 600, 2, seed=5, tokenizer=tokenizer, sources=sources)
    other = build_sample(task, 600, 2, seed=6, tokenizer=tokenizer, sources=sources)
    assert first == again
    assert first.token_ids != other.token_ids


def test_variable_tracking_chains_every_hop(sources):
    tokenizer = CharTokenizer()
    sample = build_sample("vt", 800, 0, seed=1, tokenizer=tokenizer, sources=sources)
    text = tokenizer.decode(sample.token_ids)
    names = sample.references
    assert len(names) == 5
    for previous, current in zip(names, names[1:]):
        assert f"VAR {current} = VAR {previous}." in text
    assert text.index(f"VAR {names[0]} =") < text.index(f"VAR {names[-1]} =")


@pytest.mark.parametrize(("output", "references", "metric", "expected"), [
    ("The numbers are 123 and 456.", ("123", "456"), "all", 1.0),
    ("The numbers are 123.", ("123", "456"), "all", 0.5),
    ("nothing here", ("123", "456"), "all", 0.0),
    ("The numbers are 123.", ("123", "456"), "part", 1.0),
    ("ALPHA and beta", ("alpha", "Beta"), "all", 1.0),
])
def test_score_hand_cases(output, references, metric, expected):
    assert score(output, references, metric) == expected


def test_task_selection_and_errors():
    assert parse_tasks("all") == list(TASKS)
    assert parse_tasks("niah")[:2] == ["niah_single_1", "niah_single_2"] and len(parse_tasks("niah")) == 8
    assert parse_tasks("vt,cwe") == ["vt", "cwe"]
    with pytest.raises(ConfigError, match="tasks"):
        parse_tasks("qa_1")
    with pytest.raises(ConfigError, match="length"):
        build_sample("cwe", 100, 0, 0, CharTokenizer(), make_sources(None))


def test_vocabulary_hand_case():
    assert vocabulary("The Cat sat; the cat SAT on Mats and carpets, mats!") == ("mats", "carpets")
