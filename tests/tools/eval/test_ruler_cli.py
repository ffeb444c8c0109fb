"""`kvforge eval ruler` end to end on a tiny model: every system sees the same prompts, and
exact caches give token-identical answers to transformers."""

from __future__ import annotations

import json

from tiny_eval import tiny_models  # noqa: F401

from kvforge.cli import main


def test_cli_scores_every_task_on_the_same_samples(tiny_models, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "ruler.json"
    code = main(["eval", "ruler", "--model", "tiny", "--threads", "1", "--lengths", "700", "--samples", "2",
                 "--tasks", "niah_single_1,vt,fwe", "--batch", "2", "--prefill-chunk", "64",
                 "--compare", "hf", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| niah_single_1" in printed and "| average" in printed
    payload = json.loads(out.read_text())
    ours, theirs = payload["systems"]
    assert payload["baseline"] == "hf"
    assert set(ours["scores"]) == {"niah_single_1", "vt", "fwe"}
    assert len(ours["samples"]) == 6
    assert all(s["prompt_tokens"] <= 700 for s in ours["samples"])
    assert [s["references"] for s in ours["samples"]] == [s["references"] for s in theirs["samples"]]
    assert [s["output_ids"] for s in ours["samples"]] == [s["output_ids"] for s in theirs["samples"]]
    for system in (ours, theirs):
        assert 0.0 <= system["average"] <= 100.0
