"""ShadowKV's quality/memory front: ranks and bytes per setting from key energy curves and the
cache's accounting, the front marking, and the README table."""

from __future__ import annotations

import json

import pytest
import torch

from kvforge.cache.registry import create_cache
from kvforge.errors import ConfigError
from kvforge.models.hf_checkpoint import CONFIG_FILE
from kvforge.tools.eval.shadowkv_front import front
from kvforge.tools.report.shadowkv_front import front_table, on_front


def _model(tmp_path) -> str:
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 128, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 8192, "rope_theta": 10000.0}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    return str(tmp_path)


def _ppl(cache_specs: dict[str, float], windows: int = 2) -> dict:
    return {"settings": {"context": 8192, "windows": windows, "prefill_len": 4096, "mode": "decode"},
            "text_file": "t.txt", "systems": [{"name": f"kvforge[{spec}]", "cache": spec, "ppl": ppl}
                                               for spec, ppl in cache_specs.items()]}


def test_front_ranks_and_bytes_follow_the_rule_and_the_accounting(tmp_path):
    model = _model(tmp_path)  # 2 layers, KV width 2 x 32 = 64
    width = 64
    steep = torch.tensor([0.9 ** i for i in range(width)], dtype=torch.float64)
    flat = torch.ones(width, dtype=torch.float64)
    curves = [(s / s.sum()).cumsum(0) for s in (steep, flat)]
    spectra = {"num_tokens": 4096, "layers": [{"layer": i, "keys_pre_rope": {"energy": c.tolist()}}
                                              for i, c in enumerate(curves)]}
    full = _ppl({"full": 10.0})
    runs = [_ppl({"shadowkv:rank=auto,energy=0.9": 11.0, "shadowkv:rank=32": 10.5, "full": 10.0})]  # full: not a row
    doc = front(model, spectra, full, runs)
    auto, fixed = doc["systems"]
    expected = [int((c < 0.9 - 1e-9).sum()) + 1 for c in curves]
    assert auto["ranks"] == [max(16, r) for r in expected] and expected[0] < expected[1]
    assert fixed["ranks"] == [32, 32]
    cache = create_cache("shadowkv:rank=32", _layout(model), 1 << 30, torch.float32, "cpu")
    assert fixed["fast_bytes"] == cache.memory.compressed_global_bytes(4096, 32)
    assert doc["full"]["global_bytes"] == 2 * 4096 * 2 * width * 4  # K and V of both layers, fp32
    assert fixed["times_smaller"] == pytest.approx(doc["full"]["global_bytes"] / fixed["fast_bytes"])
    assert auto["delta_pct"] == pytest.approx(10.0)
    with pytest.raises(ConfigError, match="runs"):
        front(model, spectra, full, [_ppl({"shadowkv": 11.0}, windows=1)])


def _layout(model: str):
    from kvforge.models.loader import load_model_config, resolve_model_source
    from kvforge.models.registry import model_class

    config = load_model_config(resolve_model_source(model))
    return model_class(config).layout_for(config)


def test_front_marks_rows_no_other_row_beats_on_bytes_and_perplexity():
    rows = [{"fast_bytes": b, "ppl": p} for b, p in ((10, 12.0), (20, 11.0), (20, 11.5), (30, 11.2))]
    assert on_front(rows) == [True, True, False, False]


def test_front_table_sorts_by_bytes():
    doc = {"model": "m", "bytes_at_tokens": 32768, "ppl_settings": {"windows": 2, "context": 8192, "prefill_len": 4096},
           "full": {"ppl": 10.0, "global_bytes": 3 * 2**20},
           "systems": [{"name": "kvforge[shadowkv:rank=64]", "ranks": [64, 64], "fast_bytes": 2**20,
                        "times_smaller": 3.0, "ppl": 10.5, "delta_pct": 5.0},
                       {"name": "kvforge[shadowkv]", "ranks": [20, 40], "fast_bytes": 2**19, "times_smaller": 6.0,
                        "ppl": 11.0, "delta_pct": 10.0,
                        "ruler": {"seeds": [0, 1], "average": 34.66, "full_average": 35.6, "delta_points": -0.94}}],
           "ruler_settings": {"lengths": [8192], "tasks": ["a", "b"], "samples_per_task": 2}}
    text = front_table(doc, "eval/f.json")
    lines = [line for line in text.splitlines() if line.startswith("| kvforge")]
    assert lines[0] == "| kvforge[shadowkv] * | 20/40 | 0.5 | 6.00x | 11.000 | +10.00% | 34.7 (35.6) |"
    assert lines[1] == "| kvforge[shadowkv:rank=64] * | 64/64 | 1.0 | 3.00x | 10.500 | +5.00% |  |"
    assert "(results/eval/f.json)" in text and "3.0 MiB" in text
    assert "RULER: average over 2 tasks at 8192 tokens, 2 samples per task and seed" in text
    doc["systems"][1]["ruler"] = {"seeds": [1], "average": 20.0, "full_average": 30.0, "delta_points": -10.0}
    assert "| 20.0 (30.0) 1 seed |" in front_table(doc)
    for system in doc["systems"]:  # no RULER anywhere: no RULER column
        system["ruler"] = None
    assert "RULER" not in front_table({**doc, "ruler_settings": None})


def _ruler(model: str, seed: int, averages: dict[str, float], samples: int = 2, dtype: str = "float32",
           prefix: str = "kvforge") -> dict:
    return {"model": model, "dtype": dtype,
            "settings": {"lengths": [8192], "tasks": ["a", "b"], "samples_per_task": samples,
                         "seed": seed, "chat": False, "haystack_file": None},
            "systems": [{"name": f"{prefix}[{spec}]", "kind": "kvforge", "cache": spec, "average": value}
                        for spec, value in averages.items()]
                       + [{"name": "hf", "kind": "hf", "cache": None, "average": 99.0}]}


def test_ruler_scores_join_their_setting_over_the_seeds_that_scored_it_and_the_full_cache(tmp_path):
    model = _model(tmp_path)
    width = 64
    curve = (torch.ones(width, dtype=torch.float64) / width).cumsum(0)
    spectra = {"num_tokens": 4096, "layers": [{"layer": i, "keys_pre_rope": {"energy": curve.tolist()}}
                                              for i in range(2)]}
    runs = [_ppl({"shadowkv:rank=auto": 11.0, "shadowkv:rank=32": 10.5, "shadowkv:rank=auto,energy=0.9": 12.0})]
    ruler = [_ruler(model, 0, {"full": 40.0, "full:storage_dtype=float16": 1.0}), _ruler(model, 1, {"full": 30.0}),
             # energy=0.999 spelled out is the same setting as bare `shadowkv:rank=auto`
             _ruler(model, 0, {"shadowkv:rank=auto,energy=0.999": 38.0}), _ruler(model, 1, {"shadowkv:rank=auto": 29.0}),
             # seed 2 has no full-cache run: not counted
             _ruler(model, 2, {"shadowkv:rank=32": 99.0}), _ruler(model, 0, {"shadowkv:rank=32": 20.0})]
    doc = front(model, spectra, _ppl({"full": 10.0}), runs, ruler=ruler)
    by_cache = {s["cache"]: s["ruler"] for s in doc["systems"]}
    assert by_cache["shadowkv:rank=auto"] == {"seeds": [0, 1], "average": 33.5, "full_average": 35.0, "delta_points": -1.5}
    assert by_cache["shadowkv:rank=32"] == {"seeds": [0], "average": 20.0, "full_average": 40.0,
                                            "delta_points": -20.0}
    assert by_cache["shadowkv:rank=auto,energy=0.9"] is None
    assert doc["ruler_settings"]["samples_per_task"] == 2
    # a front file rebuilds the same front (its global layers' curves are kept)
    from kvforge.tools.eval.shadowkv_front import spectra_of_front

    again = front(model, spectra_of_front(doc), _ppl({"full": 10.0}), runs, ruler=ruler)
    assert [s["ranks"] for s in again["systems"]] == [s["ranks"] for s in doc["systems"]]
    bad_runs = {"other settings": _ruler(model, 0, {"full": 1.0}, samples=3),
                "another dtype": _ruler(model, 0, {"full": 1.0}, dtype="bfloat16"),
                "a SwiftKV model's run": _ruler(model, 3, {"shadowkv:rank=auto": 1.0}, prefix="swiftkv"),
                "a setting scored twice for a seed": _ruler(model, 1, {"shadowkv:rank=auto,energy=0.999": 1.0})}
    for why, bad in bad_runs.items():
        with pytest.raises(ConfigError, match="ruler"):
            front(model, spectra, _ppl({"full": 10.0}), runs, ruler=ruler + [bad])
            pytest.fail(why)
    with pytest.raises(ConfigError, match="ruler"):
        front(model, spectra, _ppl({"full": 10.0}), runs, ruler=ruler + [_ruler("other", 0, {"full": 1.0})])


def test_many_layers_show_the_mean_rank_and_its_range():
    from kvforge.tools.report.shadowkv_front import _ranks

    assert _ranks([10, 20, 30]) == "10/20/30"
    assert _ranks([10, 20, 30, 40, 50, 60, 70, 80]) == "mean 45 (10-80)"


def test_rank_attention_rows_take_their_measured_ranks_and_need_them(tmp_path):
    model = _model(tmp_path)
    curve = (torch.ones(64, dtype=torch.float64) / 64).cumsum(0)
    spectra = {"num_tokens": 4096, "layers": [{"layer": i, "keys_pre_rope": {"energy": curve.tolist()}}
                                              for i in range(2)]}
    full = _ppl({"full": 10.0})
    runs = [_ppl({"shadowkv:rank=attention": 10.4})]
    measured = {"eval": "shadowkv-ranks", "model": model, "num_tokens": 4096,
                "systems": [{"cache": "shadowkv:rank=attention,attention_error=0.1", "ranks": [24, 40]}]}
    row = front(model, spectra, full, runs, rank_file=measured)["systems"][0]
    assert row["ranks"] == [24, 40]  # the default attention_error: one setting, two spellings
    cache = create_cache("shadowkv:rank=attention", _layout(model), 1 << 30, torch.float32, "cpu")
    assert row["fast_bytes"] == cache.memory.compressed_global_bytes(4096, [24, 40])
    with pytest.raises(ConfigError, match="ranks"):
        front(model, spectra, full, runs)  # no measurement: refused, not guessed from the spectra
    with pytest.raises(ConfigError, match="ranks"):
        front(model, spectra, full, runs, rank_file={**measured, "num_tokens": 2048})  # another passage
