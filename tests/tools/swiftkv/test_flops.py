"""SwiftKV FLOP accounting: the paper's Table 1 for Llama-3.1-70B, and the bench's
per-step prefill FLOPs of a SwiftKV model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvforge.cli import main
from kvforge.config import SwiftKVConfig
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.tools.bench.flops import prefill_flops
from kvforge.tools.swiftkv.flops import flops_table, prompt_token_flops

LLAMA_70B = json.loads((Path(__file__).parents[3] / "examples" / "llama-3.1-70b-config.json").read_text())


def test_llama_70b_matches_the_paper_within_5_percent():
    config = config_from_hf_dict(LLAMA_70B)
    rows = flops_table(config, 131072, [SwiftKVConfig(60), SwiftKVConfig(40), SwiftKVConfig(40, 4)])
    paper = [302, 228, 154, 153]  # GFLOP per prompt token, SwiftKV paper Table 1
    for row, expected in zip(rows, paper):
        assert row["total"] == pytest.approx(expected, rel=0.05), row["setting"]
    assert rows[2]["ratio"] == pytest.approx(0.5, abs=0.01)


def test_parts_by_hand_on_a_small_config():
    config = config_from_hf_dict(dict(model_type="llama", vocab_size=10, hidden_size=4, intermediate_size=6,
                                           num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                                           max_position_embeddings=64))
    base = prompt_token_flops(config, context=3)
    # head_dim 2: q 4x4, kv 2x4 each; avg keys (1+2+3)/3 = 2
    assert (base.vocab, base.kv, base.qo, base.mlp) == (80, 4 * 2 * 4 * 4, 4 * 2 * 2 * 16, 4 * 2 * 3 * 24)
    assert base.attention == 4 * (2 * 2 * 2 * 2) * 2
    swift = prompt_token_flops(config, context=3, swiftkv=SwiftKVConfig(2, 2))
    assert swift.kv == (2 + 1) * 2 * 4 * 4 and swift.qo == base.qo / 2 and swift.attention == base.attention / 2


def test_bench_prefill_flops_of_a_swiftkv_model():
    config = config_from_hf_dict(LLAMA_70B)
    base = prefill_flops(config, 1000)
    half = prefill_flops(replace(config, swiftkv=SwiftKVConfig(40)), 1000)
    assert half.lm_head == base.lm_head
    h, inter, q, kv = 8192, 28672, 8192, 1024
    other, kv_weights = 2 * h * q + 3 * h * inter, 2 * h * kv  # per layer: q,o,mlp; k,v
    # every prompt token: 40 full layers + 40 leaders' K/V; the last token: 40 later layers' rest
    assert half.linear == 2 * 1000 * (40 * (other + kv_weights) + 40 * kv_weights) + 2 * 40 * other
    assert base.linear == 2 * 1000 * 80 * (other + kv_weights)
    assert half.attention / base.attention == pytest.approx(0.5, abs=0.01)


def test_cli_prints_the_table(capsys, tmp_path):
    config_path = Path(__file__).parents[3] / "examples" / "llama-3.1-70b-config.json"
    out = tmp_path / "flops.json"
    assert main(["swiftkv", "flops", "--config", str(config_path), "--num-key-value-layers", "60,40,40",
                 "--group-size", "1,1,4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4-way AcrossKV" in text and "baseline" in text
    assert len(json.loads(out.read_text())["rows"]) == 4
    assert main(["swiftkv", "flops", "--config", str(config_path), "--num-key-value-layers", "60,40",
                 "--group-size", "1,1,4"]) == 2


def test_the_printed_totals_are_the_sums_of_the_printed_parts_and_give_the_ratio(capsys):
    """The table rounds every column alike: its total is its parts' sum and total over the
    baseline's is its `vs baseline` (a total rounded coarser once read 0.6 / 0.3 beside 0.563)."""
    assert main(["swiftkv", "flops", "--model", "smollm2-135m", "--num-key-value-layers", "15"]) == 0
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "setting" not in line]
    numbers = [[float(cell) for cell in row[1:]] for row in rows]
    for *parts, total, _ratio in numbers:
        assert sum(parts) == pytest.approx(total, abs=0.011 * len(parts))
    assert numbers[1][-2] / numbers[0][-2] == pytest.approx(numbers[1][-1], abs=0.02)
