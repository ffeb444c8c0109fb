"""README's KIVI quality/memory table (between `<!-- kivi-pareto:start -->` and
`<!-- kivi-pareto:end -->`), rendered from the committed `eval ppl` files in PARETO_FILES.

One table per file (a model): every system of the run with its stored bits per K/V element
(eval/storage.py: codes + scales/zeros + sinks amortised over the window; the residual is
listed beside), decode perplexity and its change against the run's baseline. A row is on
the Pareto front when no other row of the run stores at most as many bits with a lower
perplexity; those rows are marked.
"""

from __future__ import annotations

from typing import Any

from kvforge.report.render import fmt, table

START, END = "<!-- kivi-pareto:start -->", "<!-- kivi-pareto:end -->"
PARETO_FILES = ("eval/pareto_kivi_smollm2-135m.json", "eval/pareto_kivi_gemma3-270m.json")


def on_front(rows: list[dict[str, Any]]) -> list[bool]:
    """Per row: True when no other row has bits <= its bits and a strictly lower ppl (rows
    without a bit count are never on the front, and never push others off it)."""
    front = []
    for row in rows:
        bits = row.get("stored_bits_per_element")
        front.append(bits is not None and not any(
            other is not row and other.get("stored_bits_per_element") is not None
            and other["stored_bits_per_element"] <= bits and other["ppl"] < row["ppl"] for other in rows))
    return front


def _residual(row: dict[str, Any]) -> str:
    if row.get("residual_tokens") is None:
        return "-"
    return f"{row['residual_tokens']} x {row['residual_bits']}-bit"


def pareto_table(path: str, doc: dict[str, Any]) -> str:
    s = doc["settings"]
    rows = sorted(doc["systems"], key=lambda r: (r.get("stored_bits_per_element") or 1e9, r["ppl"]))
    front = on_front(rows)
    body = [[r["name"] + (" *" if f else ""), fmt(r.get("stored_bits_per_element"), "{:.2f}"), _residual(r),
             fmt(r["ppl"], "{:.3f}"), fmt(r.get("delta_pct"), "{:+.2f}%")] for r, f in zip(rows, front)]
    head = (f"**{doc['model']}**: decode perplexity, {s['windows']} windows of {s['context']} tokens "
            f"(prefill {s['prefill_len']}), baseline {doc['baseline']} ([{path.rsplit('/', 1)[-1]}]"
            f"(docs/results/{path})); * on the Pareto front\n\n")
    return head + table(["system", "bits/element", "residual", "perplexity", "vs baseline"], body)


def pareto_block(results: dict[str, dict[str, Any]]) -> str:
    parts = [pareto_table(path, results[path]) for path in PARETO_FILES if path in results]
    return "\n\n".join(parts) if parts else "(no Pareto run committed yet)"
