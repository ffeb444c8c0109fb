"""`kvforge report`: the committed docs match the committed result JSON (a table that drifts
from its file fails here), each kind of result renders, and --check notices a change."""

from __future__ import annotations

import json
import shutil
from argparse import Namespace
from pathlib import Path

import pytest

from kvforge.tools.report.cli import END, START, load_results, render_results, run_report
from kvforge.tools.report.headline import headline_table
from kvforge.tools.report.render import render_document

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "docs" / "results"


def test_docs_results_md_and_readme_table_match_the_committed_json():
    results = load_results(RESULTS)
    assert results, "no committed result files"
    assert (ROOT / "docs" / "results.md").read_text() == render_results(results)
    readme = (ROOT / "README.md").read_text()
    block = readme.split(START, 1)[1].split(END, 1)[0].strip()
    assert block == headline_table(results).strip()


def test_every_committed_result_names_its_source():
    for path, doc in load_results(RESULTS).items():
        section = render_document(f"docs/results/{path}", doc)
        assert f"file `docs/results/{path}`" in section
        assert "|" in section  # a table


def test_check_notices_a_changed_figure(tmp_path):
    shutil.copytree(RESULTS, tmp_path / "results")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(ROOT / "docs" / "cache-methods.md", tmp_path / "cache-methods.md")
    args = Namespace(directory=str(tmp_path / "results"), out=str(tmp_path / "results.md"),
                     readme=str(tmp_path / "README.md"), methods=str(tmp_path / "cache-methods.md"), check=False,
                     plots=False)
    assert run_report(args) == 0  # render into the copy
    assert run_report(Namespace(**{**vars(args), "check": True})) == 0
    target = next((tmp_path / "results").rglob("*.json"))
    doc = json.loads(target.read_text())
    doc["model"] = doc.get("model", "") + "-edited"
    target.write_text(json.dumps(doc))
    assert run_report(Namespace(**{**vars(args), "check": True})) == 1


def test_a_flagged_result_says_it_is_not_trustworthy():
    doc = {"benchmark": "prefill", "model": "m", "dtype": "float32", "threads": 2, "settings": {"prompt_len": 8},
           "headline_metric": "prompt_tokens_per_s", "ratios": {},
           "systems": [{"name": "kvforge[full]", "prompt_tokens_per_s": 10.0, "repeat_spread": 1.0}],
           "flags": [{"kind": "loaded_machine", "message": "other programs kept 1.00 of 2 cores busy"}],
           "provenance": {"command": "kvforge bench prefill", "date": "2026-11-25 06:00 UTC", "machine": "a CPU"}}
    section = render_document("docs/results/x.json", doc)
    assert "**Not trustworthy:** other programs kept 1.00 of 2 cores busy" in section
    assert "`kvforge bench prefill`; 2026-11-25 06:00 UTC; a CPU" in section


@pytest.mark.parametrize("device, environment, where", [
    ("cpu", {}, "m float32, 2 threads;"),
    ("cuda", {}, "m float32, on cuda;"),
    ("cuda:0", {"device_name": "NVIDIA H200"}, "m float32, on cuda:0 (NVIDIA H200);"),
])
def test_a_bench_says_where_it_ran(device, environment, where):
    """On a GPU the CPU thread count says nothing; the device and its name do."""
    doc = {"benchmark": "decode", "model": "m", "dtype": "float32", "threads": 2, "device": device,
           "environment": environment, "settings": {"batch": 1}, "headline_metric": "generated_tokens_per_s",
           "ratios": {}, "systems": [{"name": "kvforge[full]", "generated_tokens_per_s": 10.0}], "flags": [],
           "provenance": {"command": "kvforge bench decode"}}
    assert where in render_document("docs/results/x.json", doc)


def test_prefix_hit_rate_is_rendered_from_the_conversation_counters():
    """The rate shown is hit tokens / queried tokens, not a stored rate (older files hold a
    rate that was subtracted across conversations)."""
    counters = {"prefix_queried_tokens": 400, "prefix_hit_tokens": 300, "prefix_hit_rate": 0.0}
    doc = {"benchmark": "prefix", "model": "m", "dtype": "float32", "threads": 2, "settings": {"turns": 3},
           "headline_metric": "first_tokens_per_s_turns_2_n", "ratios": {}, "outputs_identical": True,
           "systems": [{"name": "cached", "prefix_caching": True, "prefix": counters, "prefix_hit_rate": 0.0},
                       {"name": "recomputed", "prefix_caching": False, "prefix": {}}],
           "provenance": {"command": "kvforge bench prefix", "date": "2026-11-25 06:00 UTC", "machine": "a CPU"}}
    rows = [line for line in render_document("docs/results/x.json", doc).splitlines() if line.startswith("| ")]
    assert rows[1].split("|")[4].strip() == "0.75"
    assert rows[2].split("|")[4].strip() == "-"


def test_a_results_file_that_is_not_a_result_is_refused(tmp_path):
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a kvforge result"):
        render_results(load_results(tmp_path))


def test_a_gpu_check_seed_sweep_renders_one_line_per_row():
    doc = json.loads((RESULTS / "gpu" / "h200_run4_tiny_seeds.json").read_text())
    text = render_document("docs/results/gpu/h200_run4_tiny_seeds.json", doc)
    assert "(gpu-check-seeds)" in text and "from one draw" in text
    assert text.count("| FAIL |") == sum(not r["passed"] for r in doc["rows"]) == 8
    assert len([line for line in text.splitlines() if line.startswith("| ") and "tiny/" in line]) == len(doc["rows"])


def test_a_gpu_check_result_renders_its_rows():
    doc = json.loads((RESULTS / "gpu" / "h100_run1_gpu-check.json").read_text())
    text = render_document("docs/results/gpu/h100_run1_gpu-check.json", doc)
    assert "(gpu-check)" in text and "NVIDIA H100" in text
    assert sum(line.endswith("  pass") for line in text.splitlines()) == doc["rows_passed"] == len(doc["rows"])
    assert f"correctness: {doc['rows_passed']}/{len(doc['rows'])} rows passed" in text


def test_a_flagged_file_carries_its_flags_into_the_readme_row():
    from kvforge.tools.report.headline import _caveat

    assert _caveat({"flags": []}) == ""
    flagged = {"flags": [{"kind": "loaded_machine", "message": "..."}, {"kind": "noisy_repeats", "message": "..."}]}
    assert _caveat(flagged) == " (flagged: machine loaded, noisy repeats)"
    readme = (ROOT / "README.md").read_text()
    for path, doc in load_results(RESULTS).items():
        if doc.get("flags") and path in readme:
            row = next(line for line in readme.splitlines() if path in line)
            assert "(flagged:" in row, path


def test_the_bf16_kivi_row_says_how_the_systems_were_ordered():
    """A ratio from systems run one after another depends on their order on a drifting machine:
    the row says which ran first, or that the run alternated them over rounds."""
    from kvforge.tools.report.rows import _kivi_long_context_int8

    def system(name, tokens_per_s, attention_ms):
        return {"name": name, "generated_tokens_per_s": tokens_per_s, "decode_attention_ms": attention_ms}

    settings = {"num_requests": 32, "input_len": 2048, "output_len": 1024, "kv_budget": 300_000_000}
    kivi, full = system("kvforge[kivi:key_dot=int8]", 150.0, 30.0), system("kvforge[full:storage_dtype=float16]",
                                                                            100.0, 15.0)
    alternated = _kivi_long_context_int8({"systems": [kivi, full], "settings": {**settings, "rounds": 2}})
    assert "**1.50x**" in alternated and "2 rounds in alternating order" in alternated
    assert "the full cache run first" in _kivi_long_context_int8({"systems": [full, kivi], "settings": settings})
    assert "KIVI run first" in _kivi_long_context_int8({"systems": [kivi, full], "settings": {**settings, "rounds": 1}})


def test_the_bf16_kivi_row_shows_each_runs_ratio():
    """The merged ratio takes each system's median round; when one system's rounds differ
    (drift), each run's own ratio shows beside it, in run order."""
    from kvforge.tools.report.rows import _kivi_long_context_int8

    settings = {"num_requests": 32, "input_len": 2048, "output_len": 1024, "kv_budget": 300_000_000, "rounds": 2}
    kivi = {"name": "kvforge[kivi:key_dot=int8]", "generated_tokens_per_s": 150.0, "decode_attention_ms": 30.0,
            "seconds_all": [200.0, 200.0]}
    full = {"name": "kvforge[full:storage_dtype=float16]", "generated_tokens_per_s": 80.0, "decode_attention_ms": 15.0,
            "seconds_all": [330.0, 360.0]}
    row = _kivi_long_context_int8({"systems": [kivi, full], "settings": settings})
    assert "per run 1.65x, 1.80x" in row
    single = _kivi_long_context_int8({"systems": [{**kivi, "seconds_all": [200.0]}, {**full, "seconds_all": [330.0]}],
                                      "settings": {**settings, "rounds": 1}})
    assert "per run" not in single


def test_the_fp32_kivi_row_shows_each_runs_ratio_too():
    from kvforge.tools.report.rows import _kivi_long_context

    def system(name, seconds_all):
        return {"name": name, "peak_concurrent_sequences": 4, "generated_tokens_per_s": 100.0, "decode_seconds": 10.0,
                "attention_gflops": 1.0, "seconds_all": seconds_all}

    settings = {"num_requests": 32, "input_len": 2048, "output_len": 1024, "kv_budget": 300_000_000}
    row = _kivi_long_context({"systems": [system("kvforge[kivi]", [300.0, 310.0]),
                                          system("kvforge[full:storage_dtype=float16]", [450.0, 496.0])],
                              "settings": settings})
    assert "per run 1.50x, 1.60x" in row
