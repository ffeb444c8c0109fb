"""KIVI's quality/memory table in the methods guide (docs/cache-methods.md, between
`<!-- kivi-pareto:start -->` and `<!-- kivi-pareto:end -->`), rendered from the committed
`eval ppl` files in PARETO_FILES.

One table per model: every system of its files with its stored bits per K/V element
(eval/storage.py: codes + scales/zeros + sinks amortised over the window; the residual is
listed beside), decode perplexity and its change against the first file's baseline. A
later file joins only when it scored the same windows (model, text, context, prefill,
window count), so every row is comparable, and a system it scored again keeps the first
file's row; the change is recomputed from the perplexities
(a run that stopped early has no deltas of its own). A row is on the Pareto front when no
other row stores at most as many bits with a lower perplexity; those rows are marked.
"""

from __future__ import annotations

from typing import Any

from kvforge.tools.report.markdown import fmt, table

START, END = "<!-- kivi-pareto:start -->", "<!-- kivi-pareto:end -->"
PARETO_FILES = {
    "smollm2-135m": ("eval/pareto_kivi_smollm2-135m.json", "eval/pareto_kivi_smollm2-135m_beyond_paper.json",
                     "eval/pareto_kivi_smollm2-135m_k4v2_g64.json", "eval/pareto_kivi_smollm2-135m_quality3.json",
                     "eval/pareto_kivi_smollm2-135m_hf_quanto.json", "eval/pareto_kivi_smollm2-135m_key_dot_int8.json",
                     "eval/pareto_kivi_smollm2-135m_quality2_key_dot_int8.json", "eval/pareto_kivi_smollm2-135m_int8_kv.json",
                     "eval/pareto_kivi_smollm2-135m_quality2_int8_kv.json"),
    "gemma3-270m": ("eval/pareto_kivi_gemma3-270m.json", "eval/pareto_kivi_gemma3-270m_k4v2_g64.json",
                    "eval/pareto_kivi_gemma3-270m_2bit_keyside.json",
                    "eval/pareto_kivi_gemma3-270m_prerope_sinks_hadamard_values.json",
                    "eval/pareto_kivi_gemma3-270m_prerope_sinks.json", "eval/pareto_kivi_gemma3-270m_key_dot_int8.json",
                    "eval/pareto_kivi_gemma3-270m_quality2_key_dot_int8.json", "eval/pareto_kivi_gemma3-270m_int8_kv.json",
                    "eval/pareto_kivi_gemma3-270m_quality2_int8_kv.json"),
}
SAME_WINDOWS = ("model", "text_file")
SAME_SETTINGS = ("context", "prefill_len", "windows", "mode")


def same_windows(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in SAME_WINDOWS) and \
        all(a["settings"].get(k) == b["settings"].get(k) for k in SAME_SETTINGS)


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


def _baseline(doc: dict[str, Any]) -> dict[str, Any]:
    """The run's baseline system: the one it names, else its first system (the --cache one,
    which a run that stopped early still has)."""
    name = doc.get("baseline")
    return next((r for r in doc["systems"] if r["name"] == name), doc["systems"][0])


def pareto_table(docs: dict[str, dict[str, Any]]) -> str:
    """docs: path -> eval ppl document, the first one holding the baseline."""
    (first_path, first), *_ = docs.items()
    joined = {path: doc for path, doc in docs.items() if same_windows(first, doc)}
    base = _baseline(first)
    # A system scored again by a later file (e.g. its own full-cache baseline) appears once:
    # the first file's row.
    unique: dict[str, dict[str, Any]] = {}
    for doc in joined.values():
        for r in doc["systems"]:
            unique.setdefault(r["name"], r)
    rows = sorted(unique.values(), key=lambda r: (r.get("stored_bits_per_element") or 1e9, r["ppl"]))
    front = on_front(rows)
    body = [[r["name"] + (" *" if f else ""), fmt(r.get("stored_bits_per_element"), "{:.2f}"), _residual(r),
             fmt(r["ppl"], "{:.3f}"), fmt(100 * (r["ppl"] / base["ppl"] - 1), "{:+.2f}%")]
            for r, f in zip(rows, front)]
    s = first["settings"]
    sources = ", ".join(f"[{path.rsplit('/', 1)[-1]}](results/{path})" for path in joined)
    head = (f"**{first['model']}**: decode perplexity, {s['windows']} windows of {s['context']} tokens "
            f"(prefill {s['prefill_len']}), against {base['name']} ({sources}); * on the Pareto front\n\n")
    return head + table(["system", "bits/element", "residual", "perplexity", "vs baseline"], body)


def pareto_block(results: dict[str, dict[str, Any]]) -> str:
    parts = []
    for paths in PARETO_FILES.values():
        docs = {path: results[path] for path in paths if path in results}
        if docs:
            parts.append(pareto_table(docs))
    return "\n\n".join(parts) if parts else "(no Pareto run committed yet)"
