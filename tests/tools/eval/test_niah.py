"""`kvforge eval niah` end to end on a tiny model (kvforge full vs transformers on the same
prompts), and the markdown table with deltas on hand-made results."""

from __future__ import annotations

import json

from tiny_eval import tiny_models  # noqa: F401 (fixture)

from kvforge.cli import main
from kvforge.tools.eval.niah import accuracy_grid, format_niah_table


def test_accuracy_grid_and_table_hand_cases():
    records = [{"length": n, "depth_index": d, "correct": c}
               for n, d, c in [(100, 0, True), (100, 1, False), (200, 0, True), (200, 1, True)]]
    assert accuracy_grid(records, [100, 200], [0.0, 1.0]) == [[1.0, 1.0], [0.0, 1.0]]
    results = [{"name": "a", "accuracy": 0.75, "accuracy_by_length": {"100": 0.5, "200": 1.0}},
               {"name": "b", "accuracy": 1.0, "accuracy_by_length": {"100": 1.0, "200": 1.0}}]
    table = format_niah_table(results, [100, 200], baseline=1)
    lines = table.splitlines()
    assert lines[2].split("|")[2].strip() == "50.0 (-50.0)" and lines[2].split("|")[3].strip() == "100.0"
    assert lines[4].split("|")[2].strip() == "75.0 (-25.0)"
    assert "delta in points vs b" in table


def test_cli_runs_kvforge_and_hf_on_the_same_prompts(tiny_models, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "niah.json"
    code = main(["eval", "niah", "--model", "tiny", "--threads", "1", "--lengths", "300,340", "--depths", "2", "--max-new-tokens", "6",
                 "--batch", "2", "--prefill-chunk", "64", "--compare", "hf,full:storage_dtype=bfloat16",
                 "--json", str(out)])
    assert code == 0
    assert "| length" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    systems = payload["systems"]
    assert [s["name"] for s in systems] == ["kvforge[full]", "hf", "kvforge[full:storage_dtype=bfloat16]"]
    assert payload["baseline"] == "hf"
    for system in systems:
        assert len(system["samples"]) == 4
        assert len(system["grid"]) == 2 and all(len(row) == 2 for row in system["grid"])
    assert len(list(tmp_path.glob("niah.*.png"))) == 3
    ours, theirs = systems[0]["samples"], systems[1]["samples"]
    assert [s["key"] for s in ours] == [s["key"] for s in theirs]
    assert all(s["prompt_tokens"] <= s["length"] for s in ours)
    # the same weights and exact caches: greedy continuations agree token for token
    assert [s["output_ids"] for s in ours] == [s["output_ids"] for s in theirs]
