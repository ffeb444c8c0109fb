"""Multi-turn needle retrieval: conversation generation is deterministic and well formed,
the engine's cache-reusing conversation loop equals recomputing the whole history, and
`kvforge eval niah --multi-turn` agrees with transformers turn by turn."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import make_pair, make_runner
from tiny_eval import CharTokenizer, tiny_models  # noqa: F401 (fixture)

from kvforge.cli import main
from kvforge.engine.conversations import converse_on_engine
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.greedy import greedy_converse, greedy_generate
from kvforge.engine.llm_engine import LLMEngine
from kvforge.tools.eval.multiturn import accuracy_by_turn, build_conversation, turn_records
from kvforge.tools.eval.niah import format_turn_table
from kvforge.tools.eval.passkey import NOISE_SENTENCES, score_output


def test_conversation_is_deterministic_and_holds_every_needle_in_depth_order():
    tokenizer = CharTokenizer()
    one = build_conversation(tokenizer, 900, 4, seed=3, sentences=NOISE_SENTENCES, sample_index=1)
    two = build_conversation(tokenizer, 900, 4, seed=3, sentences=NOISE_SENTENCES, sample_index=1)
    other = build_conversation(tokenizer, 900, 4, seed=4, sentences=NOISE_SENTENCES, sample_index=1)
    assert one == two and one.keys != other.keys
    assert sorted(one.order) == [0, 1, 2, 3] and len(one.turns) == 4
    assert len(set(one.keys)) == 4 and len(set(one.names)) == 4
    assert 900 - 40 < one.prompt_tokens <= 900
    prompt = tokenizer.decode(list(one.turns[0]))
    where = [prompt.index(f"The pass key of the {name} is {key}.") for name, key in zip(one.names, one.keys)]
    assert where == sorted(where)  # needles appear in the order of their depths
    assert one.depths == (0.0, 1 / 3, 2 / 3, 1.0)
    # the first prompt asks for needle order[0]; each later turn for the next one
    assert prompt.endswith(f"The pass key of the {one.names[one.order[0]]} is")
    for turn, needle in enumerate(one.order[1:], start=1):
        assert tokenizer.decode(list(one.turns[turn])) == (
            f"  What is the pass key of the {one.names[needle]}? The pass key of the {one.names[needle]} is")


def test_turn_records_score_each_asked_needle_and_cut_short_turns_fail():
    tokenizer = CharTokenizer()
    conv = build_conversation(tokenizer, 700, 3, seed=0, sentences=NOISE_SENTENCES)
    asked = [conv.keys[j] for j in conv.order]
    replies = [tokenizer.encode(f" {asked[0]}."), tokenizer.encode(" 12.")]  # turn 3 never answered
    records = turn_records(conv, replies, tokenizer, score_output)
    assert [r["correct"] for r in records] == [True, False, False]
    assert [r["depth_index"] for r in records] == list(conv.order)
    assert accuracy_by_turn(records, 3) == [1.0, 0.0, 0.0]
    table = format_turn_table([{"name": "a", "accuracy_by_turn": [1.0, 0.0]},
                               {"name": "b", "accuracy_by_turn": [0.5, 0.5]}], baseline=0)
    assert re.search(r"\| 2 +\| 0\.0 +\| 50\.0 \(\+50\.0\)", table)


def test_greedy_converse_equals_recomputing_the_history():
    torch.manual_seed(0)
    _, model = make_pair("llama_gqa")
    runner = make_runner(model, "full:block_size=4")
    gen = torch.Generator().manual_seed(1)
    conversations = [[torch.randint(3, 90, (n,), generator=gen).tolist() for n in lengths]
                     for lengths in ([37, 5, 9], [12, 1, 20, 3])]
    got = greedy_converse(runner, conversations, max_new_tokens=4, prefill_chunk=8)
    assert runner.cache.memory_usage()["fast"] == 0  # every sequence released
    for turns, replies in zip(conversations, got):
        assert len(replies) == len(turns) and all(len(r) == 4 for r in replies)
        history: list[int] = []
        for turn, reply in zip(turns, replies):
            history += turn
            expected = greedy_generate(runner, [history], max_new_tokens=4)[0]
            assert reply == expected
            history += reply


@pytest.mark.parametrize("spec", ["full:block_size=4", "kivi:bits=2,group=4,residual=8"])
def test_engine_conversation_reuses_earlier_turns_and_equals_recomputing_them(spec):
    """Each turn is a new request with the whole history; prefix caching finds the earlier
    turns (whole pages for full; for lossy KIVI the snapshot at the start of the previous
    prompt's last 16-token chunk), and every reply equals recomputing the history."""
    torch.manual_seed(0)
    _, model = make_pair("llama_gqa")
    gen = torch.Generator().manual_seed(2)
    conversation = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (41, 6, 11)]
    runner = make_runner(model, spec)
    engine = LLMEngine(model, runner.cache, None, EngineConfig(kv_budget_bytes=1 << 22, max_num_batched_tokens=16))
    finished = []
    got = converse_on_engine(engine, [conversation], max_new_tokens=5, on_finished=finished.append)
    assert finished == [0]
    fresh = make_runner(model, spec)
    history: list[int] = []
    prompts = []
    for turn, reply in zip(conversation, got[0]):
        history += turn
        prompts.append(len(history))
        assert reply == greedy_generate(fresh, [history], max_new_tokens=5, prefill_chunk=16)[0]
        history += reply
    stats = engine.prefix_statistics()
    assert stats["prefix_hits"] == 2  # turns 2 and 3 found the turn before
    if spec.startswith("kivi"):  # where the previous prompt's last chunk began
        expected = [(n - 1) // 16 * 16 for n in prompts[:-1]]
    else:  # the previous turn's computed tokens (all but its last reply token), whole pages
        expected = [(n + len(reply) - 1) // 4 * 4 for n, reply in zip(prompts[:-1], got[0])]
    assert stats["prefix_hit_tokens"] == sum(expected)
    engine.clear_prefix_cache()
    assert runner.cache.memory_usage()["fast"] == 0


def test_cli_multi_turn_matches_transformers(tiny_models, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "mt.json"
    code = main(["eval", "niah", "--model", "tiny", "--threads", "1", "--lengths", "650", "--multi-turn", "3",
                 "--samples", "2", "--max-new-tokens", "5", "--prefill-chunk", "128", "--compare", "hf",
                 "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "3-turn conversations" in text and "| turn" in text
    payload = json.loads(out.read_text())
    ours, theirs = payload["systems"]
    assert payload["settings"]["multi_turn"] == 3
    assert len(ours["samples"]) == 6 and len(ours["accuracy_by_turn"]) == 3 and len(ours["grid"]) == 3
    assert [s["key"] for s in ours["samples"]] == [s["key"] for s in theirs["samples"]]
    # exact caches and shared weights: every turn's reply agrees token for token
    assert [s["output_ids"] for s in ours["samples"]] == [s["output_ids"] for s in theirs["samples"]]
    assert len(list(tmp_path.glob("mt.*.png"))) == 2
