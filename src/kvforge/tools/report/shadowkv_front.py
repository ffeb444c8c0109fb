"""ShadowKV's table in docs/cache-methods.md (between `<!-- shadowkv-front:start -->` and
`<!-- shadowkv-front:end -->`) and its docs/results.md section: decode perplexity of each
rank rule against the fast-tier bytes its compressed layers hold at a long context, from the
`shadowkv-front` files benchmarks/shadowkv_front.py writes (FRONT_FILES), with RULER where
runs scored the setting.

A row is on the front when no other row stores its compressed layers in fewer bytes with a
lower perplexity; those rows are marked.
"""

from __future__ import annotations

from typing import Any

from kvforge.tools.report.markdown import fmt, table

START, END = "<!-- shadowkv-front:start -->", "<!-- shadowkv-front:end -->"
FRONT_FILES = ("eval/shadowkv_front_gemma3-270m.json", "eval/shadowkv_front_smollm2-135m.json")


def on_front(rows: list[dict[str, Any]]) -> list[bool]:
    return [not any(o is not r and o["fast_bytes"] <= r["fast_bytes"] and o["ppl"] < r["ppl"] for o in rows)
            for r in rows]


def _ranks(ranks: list[int]) -> str:
    """Every layer's rank, or for many layers their mean and range."""
    if len(ranks) <= 6:
        return "/".join(str(r) for r in ranks)
    return f"mean {sum(ranks) / len(ranks):.0f} ({min(ranks)}-{max(ranks)})"


def front_table(doc: dict[str, Any], source: str | None = None) -> str:
    rows = sorted(doc["systems"], key=lambda r: (r["fast_bytes"], r["ppl"]))
    marks = on_front(rows)
    body = [[r["name"] + (" *" if mark else ""), _ranks(r["ranks"]),
             fmt(r["fast_bytes"] / 2**20, "{:.1f}"), fmt(r["times_smaller"], "{:.2f}x"), fmt(r["ppl"], "{:.3f}"),
             fmt(r["delta_pct"], "{:+.2f}%"), _ruler(r.get("ruler"))] for r, mark in zip(rows, marks)]
    s, n = doc["ppl_settings"], doc["bytes_at_tokens"]
    where = f" ([{source.rsplit('/', 1)[-1]}](results/{source}))" if source else ""
    head = (f"**{doc['model']}**{where}: fast tier of the compressed layers at {n} tokens (full cache: "
            f"{doc['full']['global_bytes'] / 2**20:.1f} MiB) and decode perplexity, {s['windows']} windows of "
            f"{s['context']} tokens (prefill {s['prefill_len']}; full cache {doc['full']['ppl']:.3f}); "
            f"ranks per global layer (mean and range beyond 6 layers) from the key spectra of a "
            f"{doc.get('spectra_tokens', n)}-token passage"
            + ("; rank=attention's measured by compressing that passage" if doc.get("measured_ranks") else "")
            + "; * on the front"
            + _ruler_note(doc.get("ruler_settings")) + "\n\n")
    headers = ["system", "ranks", "fast tier MiB", "smaller than full", "perplexity", "vs full", "RULER (full)"]
    if not any(r.get("ruler") for r in rows):  # no RULER run scored this model's settings
        headers, body = headers[:-1], [line[:-1] for line in body]
    return head + table(headers, body)


def _ruler(score: dict[str, Any] | None) -> str:
    """'34.7 (35.6)': the setting's RULER average and the full cache's, on the same seeds."""
    if not score:
        return ""
    return f"{score['average']:.1f} ({score['full_average']:.1f})" + ("" if len(score["seeds"]) > 1 else " 1 seed")


def _ruler_note(settings: dict[str, Any] | None) -> str:
    if not settings:
        return ""
    lengths = ", ".join(str(n) for n in settings["lengths"])
    return (f"; RULER: average over {len(settings['tasks'])} tasks at {lengths} tokens, "
            f"{settings['samples_per_task']} samples per task and seed, mean over seeds "
            f"(the full cache's on the same seeds in brackets)")


def front_block(results: dict[str, dict[str, Any]]) -> str:
    parts = [front_table(results[path], path) for path in FRONT_FILES if path in results]
    return "\n\n".join(parts) if parts else "(no ShadowKV front committed yet)"
