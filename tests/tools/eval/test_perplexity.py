"""Perplexity scoring on tiny models: hand-made NLL cases, windowing, prefill and decode
modes agreeing for the exact cache, kvforge agreeing with transformers, and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_eval import tiny_models  # noqa: F401 (fixture)

from kvforge.cache.registry import create_cache
from kvforge.cli import main
from kvforge.engine.runner import ModelRunner
from kvforge.errors import ConfigError
from kvforge.tools.eval.perplexity import (
    PplSettings,
    make_windows,
    perplexity,
    score_hf,
    score_kvforge,
    window_nll,
)


def test_window_nll_hand_cases():
    uniform = torch.zeros(3, 8)
    assert window_nll(uniform, [0, 5, 7]) == pytest.approx(3 * math.log(8))
    peaked = torch.tensor([[0.0, math.log(3.0)]])  # p(target=1) = 3/4
    assert window_nll(peaked, [1]) == pytest.approx(-math.log(0.75))


def test_perplexity_of_scores():
    assert perplexity([(2 * math.log(4), 2), (math.log(4), 1)]) == pytest.approx(4.0)
    assert math.isnan(perplexity([]))


def test_make_windows_hand_cases():
    ids = list(range(10, 21))  # 11 tokens
    assert make_windows(ids, 4) == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert make_windows(ids, 4, max_windows=1) == [[10, 11, 12, 13]]
    assert make_windows(ids, 4, bos=1) == [[1, 10, 11, 12], [1, 13, 14, 15], [1, 16, 17, 18]]
    assert make_windows(ids, 12) == []


def test_settings_validate():
    with pytest.raises(ConfigError, match="prefill_len"):
        PplSettings(context=64, prefill_len=64)
    assert PplSettings(context=64, mode="prefill", prefill_len=64).context == 64
    with pytest.raises(ConfigError, match="mode"):
        PplSettings(mode="sideways")


def _windows(count: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(3, 96, (count, length), generator=generator).tolist()


def test_modes_agree_and_match_transformers(tiny_models):  # noqa: F811
    hf, ours, _ = tiny_models
    windows = _windows(3, 40)
    results = {}
    for mode in ("prefill", "decode"):
        settings = PplSettings(context=40, mode=mode, prefill_len=8, batch=2)
        runner = ModelRunner(ours, create_cache("full:block_size=4", ours.cache_layout(), 1 << 22, torch.float32))
        results[f"kvforge-{mode}"] = score_kvforge(runner, windows, settings)
        results[f"hf-{mode}"] = score_hf(hf, lambda m=mode: None if m == "prefill" else _dynamic(hf), windows, settings)
    reference = results["hf-prefill"]
    assert [count for _, count in reference] == [39, 39, 39]
    for name, scores in results.items():
        for (nll, count), (ref_nll, ref_count) in zip(scores, reference):
            assert count == ref_count
            assert nll == pytest.approx(ref_nll, rel=1e-5), name


def _dynamic(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def test_lossy_cache_changes_decode_but_not_prefill(tiny_models):  # noqa: F811
    _, ours, _ = tiny_models
    windows = _windows(2, 48)

    def score(spec: str, mode: str) -> float:
        settings = PplSettings(context=48, mode=mode, prefill_len=4, batch=2)
        runner = ModelRunner(ours, create_cache(spec, ours.cache_layout(), 1 << 22, torch.float32))
        return perplexity(score_kvforge(runner, windows, settings))

    exact = score("full", "decode")
    assert score("full:storage_dtype=bfloat16", "prefill") == pytest.approx(score("full", "prefill"), rel=1e-6)
    assert score("full:storage_dtype=bfloat16", "decode") != exact


def test_cli_writes_table_and_json(tiny_models, tmp_path, capsys, monkeypatch):  # noqa: F811
    text = tmp_path / "text.txt"
    text.write_text("".join(f"Sentence number {i} is here. " for i in range(400)))
    out = tmp_path / "ppl.json"
    code = main(["eval", "ppl", "--model", "tiny", "--threads", "1", "--text-file", str(text), "--context", "48", "--mode", "decode",
                 "--prefill-len", "8", "--max-windows", "3", "--batch", "2", "--compare",
                 "hf,full:storage_dtype=bfloat16,hf-kivi:bits=8,group=16,residual=16", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| system" in table and "delta vs hf" in table
    payload = json.loads(out.read_text())
    assert payload["baseline"] == "hf" and payload["settings"]["windows"] == 3
    names = [s["name"] for s in payload["systems"]]
    assert names == ["kvforge[full]", "hf", "kvforge[full:storage_dtype=bfloat16]",
                     "hf-kivi:bits=8,group=16,residual=16"]
    by_name = {s["name"]: s for s in payload["systems"]}
    assert all(s["tokens"] == 3 * 47 and len(s["windows"]) == 3 for s in payload["systems"])
    assert by_name["hf"]["delta_pct"] == 0.0
    assert by_name["kvforge[full]"]["ppl"] == pytest.approx(by_name["hf"]["ppl"], rel=1e-5)
    assert by_name["hf-kivi:bits=8,group=16,residual=16"]["hf_options"] == {"bits": 8, "group": 16, "residual": 16}


@pytest.mark.parametrize("package,entry", [("optimum.quanto", "hf-quanto:bits=4,group=16,residual=16"),
                                           ("hqq", "hf-hqq:bits=4,group=16,residual=16,axis_key=1,axis_value=1")])
def test_hf_quantized_cache_runs_when_installed(tiny_models, package: str, entry: str):  # noqa: F811
    pytest.importorskip(package)
    from kvforge.tools.eval.compare import parse_system
    from kvforge.tools.eval.context import make_hf_cache

    hf, _, _ = tiny_models
    system = parse_system(entry)
    windows = _windows(1, 40)
    settings = PplSettings(context=40, mode="decode", prefill_len=8, batch=1)
    quantized = score_hf(hf, lambda: make_hf_cache(system, hf), windows, settings)
    exact = score_hf(hf, lambda: _dynamic(hf), windows, settings)
    assert quantized[0][1] == exact[0][1] == 39
    assert quantized[0][0] != exact[0][0]
