"""`bench throughput --kv-budget A,B,...` (the SwiftKV paper's memory-constrained table), the
`merge-all-layers` reference system and per-system SwiftKV checkpoints (`SPEC@DIR`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from server_helpers import tiny_model

from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache
from kvforge.cli import main
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.errors import ConfigError
from kvforge.tools.bench import common, peak
from kvforge.tools.bench.common import parse_budgets
from kvforge.tools.bench.compare import parse_compare
from kvforge.tools.bench.merge_all_layers import MergedLayersCache, merged_layout
from kvforge.tools.report.render import render_document


def test_compare_entries_name_their_own_model():
    systems = parse_compare(["full@base,full:storage_dtype=bfloat16@ckpt/l15-g5", "kivi,bits=4@models/l15",
                             "merge-all-layers"])
    assert [(s.name, s.swiftkv, s.checkpoint, s.merge_all_layers) for s in systems] == [
        ("base[full]", False, None, False),
        ("swiftkv l15-g5[full:storage_dtype=bfloat16]", True, "ckpt/l15-g5", False),
        ("swiftkv l15[kivi:bits=4]", True, "models/l15", False),
        ("merge-all-layers[full]", False, None, True)]
    assert str(systems[1].cache) == "full:storage_dtype=bfloat16" and str(systems[2].cache) == "kivi:bits=4"
    with pytest.raises(ConfigError) as info:
        parse_compare("full@")
    assert info.value.parameter == "compare" and "SPEC@" in str(info.value)


def test_several_budgets_only_where_the_benchmark_steps_through_them():
    assert parse_budgets("16MiB, 1GiB", several=True) == (16 << 20, 1 << 30)
    assert parse_budgets("64MB", several=False) == (64_000_000,)
    for text, several in (("16MiB,32MiB", False), ("16MiB,16MiB", True)):
        with pytest.raises(ConfigError) as info:
            parse_budgets(text, several)
        assert info.value.parameter == "kv-budget"


def test_decode_refuses_several_budgets_before_loading(capsys):
    assert main(["bench", "decode", "--kv-budget", "16MiB,32MiB"]) == 2
    assert "kv-budget" in capsys.readouterr().err


def test_merged_layout_stores_one_layer_for_all_and_refuses_mixed_layers():
    model = tiny_model(layers=3)
    layout = merged_layout(model.cache_layout())
    assert layout.layer_to_cache == (0, 0, 0) and layout.num_cache_layers == 1
    # still bounded by the model's length (a method sizes stores by it)
    assert layout.max_sequence_tokens == model.config.max_position_embeddings
    mixed = CacheLayout.one_per_layer([CacheLayerSpec(2, 16, 0.25, None), CacheLayerSpec(2, 16, 0.25, 8)])
    with pytest.raises(ConfigError) as info:
        merged_layout(mixed)
    assert info.value.parameter == "merge-all-layers"


class _Spy:
    """Records the cache layer of every per-layer call and forwards to the real cache."""

    def __init__(self, cache):
        self.cache, self.calls = cache, []

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def write(self, layer, *args):
        self.calls.append(("write", layer))
        return self.cache.write(layer, *args)

    def attend(self, layer, *args):
        self.calls.append(("attend", layer))
        return self.cache.attend(layer, *args)


def test_every_layer_writes_then_attends_the_one_stored_layer():
    model = tiny_model(layers=3)
    spy = _Spy(create_cache("full:block_size=4", merged_layout(model.cache_layout()), 1 << 20, torch.float32))
    runner = ModelRunner(model, MergedLayersCache(spy))
    runner.step([StepItem(0, [5, 6, 7, 8, 9])])
    runner.step([StepItem(0, [10], decode=True)])
    assert spy.calls == [("write", 0), ("attend", 0)] * 3 * 2  # per step: each of 3 layers writes, then attends


def test_one_step_prompt_equals_the_base_model_and_the_budget_holds_layers_times_more():
    """Within one step every layer attends only the step's own tokens, which it has just
    written: a prompt prefilled in one step gives the base model's logits exactly. Stored
    bytes are one layer's, so the same budget admits L times the sequences."""
    model = tiny_model(layers=3)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    base = ModelRunner(model, create_cache("full:block_size=4", model.cache_layout(), 1 << 20, torch.float32))
    merged_cache = MergedLayersCache(create_cache("full:block_size=4", merged_layout(model.cache_layout()), 1 << 20,
                                                  torch.float32))
    merged = ModelRunner(model, merged_cache)
    item = StepItem(0, prompt, num_logits=len(prompt))
    assert torch.equal(merged.step([item]), base.step([item]))
    assert merged_cache.memory.kv_bytes_per_token() * 3 == base.cache.memory.kv_bytes_per_token()
    budget = 3 * 64 * 3 * 2 * 2 * 16 * 4  # three 64-token sequences: layers x (K, V) x heads x dims x fp32
    budget_cache = create_cache("full:block_size=4", model.cache_layout(), budget, torch.float32)
    merged_budget = MergedLayersCache(create_cache("full:block_size=4", merged_layout(model.cache_layout()), budget,
                                                   torch.float32))
    assert (budget_cache.memory.sequences_held(64), merged_budget.memory.sequences_held(64)) == (3, 9)


@pytest.fixture
def tiny_bench(monkeypatch):
    """The bench on a 3-layer tiny random Llama and a character tokenizer (no download)."""
    from server_helpers import char_tokenizer

    model, tokenizer = tiny_model(layers=3), char_tokenizer()
    monkeypatch.setattr(common, "load_kvforge", lambda name, dtype, swiftkv=None, device="cpu", load_format="auto": (model, tokenizer, name))
    monkeypatch.setattr(common, "resolve_model_source", lambda name, load_format="auto": name)
    monkeypatch.setattr(common, "load_model_config", lambda source: replace(model.config))
    monkeypatch.setattr(peak, "MATMUL_SIZE", 256)
    monkeypatch.setattr(peak, "READ_BYTES", 8 * 2**20)
    threads = torch.get_num_threads()
    yield model
    torch.set_num_threads(threads)


def test_budgets_table_runs_each_system_under_each_budget(tiny_bench, tmp_path, capsys):
    """8 requests of 24 + 4 tokens: a sequence holds 28 tokens = 7 pages of 4 in each of 3
    layers. At 48 KiB the full cache holds 2 such sequences at once, merge-all-layers 6 (one
    layer stored); at 1 MiB both run all 8."""
    out = tmp_path / "b.json"
    assert main(["bench", "throughput", "--model", "tiny", "--cache", "full:block_size=4", "--compare",
                 "merge-all-layers", "--num-requests", "8", "--input-len", "24", "--output-len", "4",
                 "--kv-budget", "48KiB,1MiB", "--admission", "reserve", "--threads", "1", "--warmup", "0",
                 "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "throughput_budgets" and result["kv_budgets"] == [48 << 10, 1 << 20]
    full, merged = result["systems"]
    assert (full["name"], merged["name"]) == ("kvforge[full:block_size=4]", "merge-all-layers[full:block_size=4]")
    assert full["kv_bytes_per_token"] == 3 * merged["kv_bytes_per_token"]
    assert [r["kv_budget"] for r in full["runs"]] == [48 << 10, 1 << 20]
    per_sequence = 7 * 4 * 3 * 2 * 2 * 16 * 4  # pages x tokens x layers x (K, V) x heads x dims x fp32
    assert full["runs"][0]["admissible_sequences"] == (48 << 10) // per_sequence == 2
    assert merged["runs"][0]["admissible_sequences"] == 6
    assert [r["peak_concurrent_sequences"] for r in full["runs"]] == [2, 8]
    assert [r["peak_concurrent_sequences"] for r in merged["runs"]] == [6, 8]
    for system in result["systems"]:
        for run in system["runs"]:
            assert run["total_tokens_per_s"] == pytest.approx(8 * 28 / run["seconds"])
    for budget, ratios in result["ratios"].items():
        index = result["kv_budgets"].index(int(budget))
        assert ratios[merged["name"]] == pytest.approx(full["runs"][index]["total_tokens_per_s"]
                                                       / merged["runs"][index]["total_tokens_per_s"])
    printed = capsys.readouterr().out
    assert "48.00 KiB" in printed and f"{full['runs'][0]['total_tokens_per_s']:.1f} (2)" in printed
    assert out.with_suffix(".png").stat().st_size > 0
    section = render_document("bench/b.json", result)  # docs/results.md's section of such a file
    first = merged["runs"][0]["total_tokens_per_s"] / full["runs"][0]["total_tokens_per_s"]
    assert f"{merged['runs'][0]['total_tokens_per_s']:.0f} ({first:.2f}x, 6 seqs)" in section
    assert "(1.00x, 8 seqs)" in section and "KV budget 1 MiB" in section


def test_budgets_refuse_the_transformers_peer(tiny_bench, capsys):
    assert main(["bench", "throughput", "--model", "tiny", "--compare", "hf", "--kv-budget", "1MiB,2MiB",
                 "--input-len", "16", "--output-len", "4", "--threads", "1"]) == 2
    assert "several --kv-budget values" in capsys.readouterr().err
