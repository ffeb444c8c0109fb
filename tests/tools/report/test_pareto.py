"""README's KIVI quality/memory table: Pareto front marking and rendering from an eval file."""

from __future__ import annotations

from kvforge.tools.report.pareto import on_front, pareto_table


def rows(*pairs):
    return [{"name": f"s{i}", "stored_bits_per_element": b, "ppl": p, "delta_pct": 0.0} for i, (b, p) in
            enumerate(pairs)]


def test_front_keeps_rows_no_other_row_beats_on_both_axes():
    systems = rows((3.0, 21.0), (3.0, 18.0), (5.0, 16.9), (32.0, 16.8), (4.0, 19.0), (None, 10.0))
    assert on_front(systems) == [False, True, True, True, False, False]


def test_table_sorts_by_bits_marks_the_front_and_lists_the_residual():
    doc = {"model": "m", "baseline": "kvforge[full]", "text_file": "t",
           "settings": {"windows": 3, "context": 2048, "prefill_len": 64, "mode": "decode"},
           "systems": [{"name": "kvforge[full]", "stored_bits_per_element": 32.0, "ppl": 10.0, "delta_pct": 0.0},
                       {"name": "kvforge[kivi:bits=2]", "stored_bits_per_element": 3.0, "ppl": 13.0,
                        "delta_pct": 30.0, "residual_tokens": 128, "residual_bits": 16},
                       {"name": "kvforge[kivi:bits=2,x]", "stored_bits_per_element": 3.1, "ppl": 14.0,
                        "delta_pct": 40.0, "residual_tokens": 128, "residual_bits": 16}]}
    later = {**doc, "systems": [{"name": "kvforge[kivi:late]", "stored_bits_per_element": 2.0, "ppl": 11.0},
                                {"name": "kvforge[full]", "stored_bits_per_element": 32.0, "ppl": 10.01}]}
    other_windows = {**later, "settings": {**doc["settings"], "windows": 2}}
    text = pareto_table({"eval/p.json": doc, "eval/q.json": later, "eval/r.json": other_windows})
    lines = [line for line in text.splitlines() if line.startswith("| kvforge")]
    # the later file joins (same windows; its delta recomputed against p's baseline), r does not
    assert lines[0].startswith("| kvforge[kivi:late] * | 2.00 | - | 11.000 | +10.00% |")
    assert lines[1].startswith("| kvforge[kivi:bits=2] | 3.00 | 128 x 16-bit | 13.000 | +30.00% |")
    assert lines[2].startswith("| kvforge[kivi:bits=2,x] | 3.10 |")  # beaten on both axes
    assert lines[3].startswith("| kvforge[full] * | 32.00 | - | 10.000 | +0.00% |")
    assert len(lines) == 4
    assert "3 windows of 2048 tokens" in text and "(results/eval/p.json)" in text
    assert "(results/eval/q.json)" in text and "r.json" not in text
