"""README's "Serve it" table: kvforge's server beside vLLM's on the same machine, weights and
workloads, from the committed `bench serve --compare vllm` results (the block between
`<!-- serving-vs-vllm:start -->` and `<!-- serving-vs-vllm:end -->`)."""

from __future__ import annotations

from typing import Any

from kvforge.tools.report.markdown import fmt

START, END = "<!-- serving-vs-vllm:start -->", "<!-- serving-vs-vllm:end -->"
# The 2-core Xeon (the machine type; its AMX hidden); the EPYC's runs are Results rows.
BURST = "serve/vllm_xeon_burst_bf16.json"
CHAT = "serve/vllm_xeon_chat_bf16.json"

Document = dict[str, Any]


def _systems(doc: Document) -> tuple[Document, Document]:
    """(kvforge's system, vLLM's) of a result."""
    ours = doc["systems"][0]
    (vllm,) = [s for s in doc["systems"] if s["kind"] == "vllm"]
    return ours, vllm


def _burst_rows(doc: Document) -> list[tuple[str, str, str, str, str]]:
    ours, vllm = (s["rates"][0]["median_of_runs"] for s in _systems(doc))
    ratios = next(iter(doc["peer_ratios"]["vllm"].values()))
    s = doc["settings"]
    workload = f"burst: {s['num_prompts']} x {s['input_len']}-token prompts, {s['output_len']} tokens each, at once"
    return [(workload, "median TTFT", f"{fmt(ours['ttft_ms_median'] / 1e3, '{:.2f}')} s",
             f"{fmt(vllm['ttft_ms_median'] / 1e3, '{:.2f}')} s", fmt(ratios["ttft_ms_median"], "{:.2f}x")),
            ("", "output tokens/s", fmt(ours["output_token_throughput"], "{:.1f}"),
             fmt(vllm["output_token_throughput"], "{:.1f}"), fmt(ratios["output_token_throughput"], "{:.2f}x")),
            ("", "median inter-token latency", f"{fmt(ours['itl_ms_median'], '{:.0f}')} ms",
             f"{fmt(vllm['itl_ms_median'], '{:.0f}')} ms", fmt(ratios["itl_ms_median"], "{:.2f}x"))]


def _chat_rows(doc: Document) -> list[tuple[str, str, str, str, str]]:
    ours, vllm = (s["chat"] for s in _systems(doc))
    ratios = doc["peer_ratios"]["vllm"]
    chat = doc["settings"]["chat"]
    workload = f"chat: {chat['turns']} turns over a {chat['shared_prefix']}-token document, history re-sent"
    rows = []
    for label, key in (("TTFT, turn 1", "first_turn_ttft_ms"), (f"TTFT, turns 2-{chat['turns']}", "later_turns_mean_ttft_ms")):
        rows.append((workload if not rows else "", label, f"{fmt(ours[key] / 1e3, '{:.3f}')} s",
                     f"{fmt(vllm[key] / 1e3, '{:.3f}')} s", fmt(ratios[key], "{:.2f}x")))
    return rows


def serving_block(results: dict[str, Document]) -> str:
    """The table, or a line saying which result is missing."""
    missing = [name for name in (BURST, CHAT) if name not in results]
    if missing:
        return f"(no serving comparison yet: {', '.join(missing)} missing)"
    burst = results[BURST]
    header = ("workload", "metric", "kvforge", f"vLLM {_vllm_label(burst)}", "kvforge better by")
    rows = [header, ("---",) * 5, *_burst_rows(burst), *_chat_rows(results[CHAT])]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _vllm_label(doc: Document) -> str:
    vllm = doc["settings"].get("vllm", {})
    cores = "both cores" if vllm.get("VLLM_CPU_OMP_THREADS_BIND") else "its defaults"
    version = vllm.get("version")  # recorded by bench serve since it reads it (None in older results)
    return f"{version} CPU ({cores})" if version else f"CPU ({cores})"
