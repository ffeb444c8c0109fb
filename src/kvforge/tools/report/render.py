"""Markdown for one result file: a table of its systems and a line saying where it came from.

Every measuring command writes JSON (bench, eval, swiftkv evaluate, the demo); this module
turns each kind into a section of docs/results.md. Values are formatted, never edited: a
section always matches its file, which is what `kvforge report --check` and the report test
compare. Files written before results recorded their command say so instead of guessing it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.tools.bench.serve_report import decode_step_split
from kvforge.tools.report.markdown import Document, fmt, table
from kvforge.tools.report.shadowkv_front import front_table


def kind_of(doc: Document) -> str:
    if "benchmark" in doc:
        return f"bench {doc['benchmark']}"
    if "eval" in doc:
        return f"eval {doc['eval']}"
    if doc.get("swiftkv_evaluate") or "students" in doc:
        return "swiftkv evaluate"
    if doc.get("swiftkv_early_exit"):
        return "swiftkv early-exit"
    if doc.get("demo"):
        return "demo"
    if doc.get("check") in ("gpu-check", "gpu-check-seeds"):
        return doc["check"]
    raise ValueError("not a kvforge result file (no benchmark, eval, students, swiftkv_early_exit, demo or check key)")


def provenance_line(path: str, doc: Document) -> str:
    prov = doc.get("provenance") or {}
    command = prov.get("command") or doc.get("command")
    parts = [f"file `{path}`", f"`{command}`" if command else "command not recorded (written before results "
                                                                  "recorded their command)"]
    if prov.get("date"):
        parts.append(prov["date"])
    if prov.get("machine"):
        parts.append(prov["machine"])
    if prov.get("note"):
        parts.append(prov["note"])
    env = doc.get("environment") or {}
    if env.get("foreign_cores") is not None:
        parts.append(f"other programs used {env['foreign_cores']:.2f} cores")
    elif env.get("load_average_before") or env.get("load_average"):
        parts.append(f"load average {env.get('load_average_before') or env.get('load_average')}")
    line = "Source: " + "; ".join(parts) + "."
    for flag in doc.get("flags", []):
        line += f"\n\n> **Not trustworthy:** {flag['message']}"
    if "flags" not in doc and (doc.get("settings") or {}).get("repeats") == 1:  # written before the flags existed
        line += "\n\n> **Note:** one timed repeat, so no spread to judge the noise by."
    if doc.get("incomplete"):
        line += f"\n\n> **Incomplete:** {doc.get('failed_system')} failed: {doc.get('error')}"
    return line


def _ratios(doc: Document, label: str) -> str:
    ratios = doc.get("ratios") or {}
    first = doc["systems"][0]["name"]
    return "".join(f"\n\n{label}: {first} / {name} = **{fmt(value, '{:.2f}')}x**" for name, value in ratios.items()
                   if value is not None)


def _where(doc: Document) -> str:
    """'2 threads' on the CPU; the device (and its name, where recorded) elsewhere."""
    device = doc.get("device") or "cpu"
    if device == "cpu":
        return f"{doc['threads']} threads"
    name = (doc.get("environment") or {}).get("device_name")
    return f"on {device}" + (f" ({name})" if name else "")


def _bench(doc: Document) -> str:
    kind = doc["benchmark"]
    columns: dict[str, list[tuple[str, str, str]]] = {
        "prefill": [("prompt_tokens_per_s", "prompt tok/s", "{:.0f}"), ("ms_to_first_token", "ms to first token", "{:.0f}"),
                    ("achieved_gflops", "GFLOP/s", "{:.1f}")],
        "decode": [("generated_tokens_per_s", "gen tok/s", "{:.1f}"), ("ms_per_step", "ms/step", "{:.1f}"),
                   ("achieved_gbps", "GB/s", "{:.2f}"), ("fraction_of_read_bandwidth", "of read BW", "{:.2f}")],
        "throughput": [("total_tokens_per_s", "total tok/s", "{:.0f}"), ("generated_tokens_per_s", "gen tok/s", "{:.1f}"),
                       ("peak_concurrent_sequences", "peak seqs", "{}"), ("preemptions", "preempt", "{}"),
                       ("prefix_hit_tokens", "prefix hit tokens", "{}")],
        "prefix": [("turn1_ttft", "turn 1 TTFT s", "{:.3f}"), ("mean_ttft_turns_2_n", "turns 2-N TTFT s", "{:.3f}"),
                   ("prefix_hit_rate", "hit rate", "{:.2f}")],
    }[kind]
    rows = []
    for system in doc["systems"]:
        if kind == "prefix":
            system = {**system, "prefix_hit_rate": _hit_rate(system)}
        held = system.get("cache_bytes_after_prefill") or {}
        extra = [fmt(held.get("fast", 0) / 2**20, "{:.0f}") + " MiB" if held else "-"]
        rows.append([system["name"], *(fmt(system.get(key), pattern) for key, _, pattern in columns), *extra,
                     fmt(system.get("repeat_spread"), "{:.2f}")])
    settings = doc.get("settings", {})
    shown = ", ".join(f"{k} {v}" for k, v in settings.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    head = f"{doc['model']} {doc['dtype']}, {_where(doc)}; {shown}\n\n"
    body = table(["system", *(label for _, label, _ in columns), "KV fast tier after prefill", "repeat spread"], rows)
    extra = ""
    if kind == "prefix":
        extra = f"\n\nReplies identical with and without prefix caching: **{str(doc['outputs_identical']).lower()}**"
    return head + body + _ratios(doc, doc["headline_metric"]) + extra


def _hit_rate(system: dict[str, Any]) -> float | None:
    """Hit tokens over queried tokens of the conversation, from the counters (files written
    before `bench prefix` computed its own rate per conversation hold a wrong rate)."""
    counters = system.get("prefix") or {}
    queried = counters.get("prefix_queried_tokens")
    if not system.get("prefix_caching") or not queried:
        return None
    return counters.get("prefix_hit_tokens", 0) / queried


def _serve_chat(doc: Document) -> str:
    chat = doc["settings"]["chat"]
    head = (f"{doc['model']} {doc['dtype']}; {doc['settings']['repeats']} conversation(s) of {chat['turns']} turns "
            f"over a {chat['shared_prefix']}-token document, {chat['question_len']}-token questions, "
            f"{chat['reply_len']}-token replies; TTFT in ms (client clock), medians over conversations\n\n")
    rows = [[s["name"], fmt(s["chat"]["first_turn_ttft_ms"], "{:.0f}"), fmt(s["chat"]["later_turns_mean_ttft_ms"], "{:.0f}"),
             str(s["chat"]["failed"])] for s in doc["systems"]]
    lines = [head + table(["system", "turn 1 TTFT", f"turns 2-{chat['turns']} TTFT", "failed"], rows)]
    first = doc["systems"][0]["name"]
    for name, ratios in doc.get("peer_ratios", {}).items():
        lines.append(f"\n{first} vs {name} (> 1: {first} answers sooner): turn 1 "
                     f"**{fmt(ratios['first_turn_ttft_ms'], '{:.2f}')}x**, later turns "
                     f"**{fmt(ratios['later_turns_mean_ttft_ms'], '{:.2f}')}x**")
    return "\n".join(lines)


def _soak(doc: Document) -> str:
    counts, memory, drained = doc["counts"], doc["memory"], doc["kv_after_drain"]
    growth = memory.get("growth")
    rows = [[doc["cache"], f"{doc['traffic_s'] / 60:.0f} min", str(counts["sent"]), str(counts["served"]),
             str(counts["refused"]), str(counts["disconnected"]), str(counts["server_error"]), str(counts["unexpected"]),
             "-" if growth is None else f"{100 * growth:+.2f}%", fmt(drained.get("kv_bytes"), "{:.0f}"),
             "pass" if doc["passed"] else "FAIL"]]
    head = (f"{doc['model']}{' + SwiftKV ' + doc['swiftkv'] if doc.get('swiftkv') else ''} {doc['dtype']}, "
            f"{doc['threads']} thread(s); requests in flight at the cap in {100 * (doc.get('saturated_fraction') or 0):.0f}% "
            f"of the samples\n\n")
    body = table(["cache", "traffic", "sent", "served", "refused (bad)", "disconnected", "5xx", "unexpected",
                  "RSS growth", "KV bytes after", "verdict"], rows)
    return head + body + "".join(f"\n- {line}" for line in doc.get("failures", []))


def _serve(doc: Document) -> str:
    if doc.get("workload") == "chat":
        return _serve_chat(doc)
    rows = []
    for system in doc["systems"]:
        for rate in system["rates"]:
            r = rate["request_rate"]
            rows.append([system["name"], "inf" if r == "inf" or (isinstance(r, float) and math.isinf(r)) else f"{r:g}",
                         f"{rate['completed']}/{rate['completed'] + rate['failed']}",
                         fmt(rate["request_throughput"], "{:.3f}"), fmt(rate["output_token_throughput"]),
                         fmt(rate["ttft_ms"]["median"], "{:.0f}"), fmt(rate["ttft_ms"]["p99"], "{:.0f}"),
                         fmt(rate["tpot_ms"]["median"], "{:.0f}"), fmt(rate["itl_ms"]["median"], "{:.0f}"),
                         fmt(rate.get("server_running_mean")) + " / " + fmt(rate.get("server_running_max"), "{:.0f}")])
    s = doc["settings"]
    head = (f"{doc['model']}{' + SwiftKV ' + doc['swiftkv'] if doc.get('swiftkv') else ''} {doc['dtype']}, "
            f"{doc['threads']} threads; {s['num_prompts']} requests per rate, input {s['input_len']}, output "
            f"{s['output_len']} tokens, KV budget {s['kv_budget']}\n\n")
    body = table(["system", "req/s offered", "done", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
                  "TPOT p50 ms", "ITL p50 ms", "running mean / max"], rows)
    lines = [head + body]
    for system in doc["systems"]:
        for rate in system["rates"]:
            for split, parts in decode_step_split(rate):
                lines.append(f"- {system['name']} at {rate['request_rate']}: a decode step takes "
                             f"{split['ms_per_step']:.1f} ms ({parts}; ms over {split['steps']} steps)")
    first = doc["systems"][0]["name"]
    for name, value in doc["ratios"].items():
        if value is not None:
            lines.append(f"\nMedian TTFT at the lowest rate: {name} / {first} = **{value:.2f}x**")
    for name, value in doc.get("throughput_ratios_at_highest_rate", {}).items():
        if value is not None:
            lines.append(f"\nRequest throughput at the highest rate: {first} / {name} = **{value:.2f}x**")
    return "\n".join(lines)


def _eval(doc: Document) -> str:
    kind = doc["eval"]
    base = doc.get("baseline")
    if kind == "ppl":
        s = doc["settings"]
        head = (f"{doc['model']}, {s['windows']} windows of {s['context']} tokens, mode {s['mode']}"
                + (f" (prefill {s['prefill_len']})" if s["mode"] == "decode" else "") + "\n\n")
        rows = [[x["name"], fmt(x["ppl"], "{:.3f}"), fmt(x.get("delta_pct"), "{:+.2f}%"),
                 fmt(x.get("stored_bits_per_element"), "{:.2f}"), x.get("tokens", "-")] for x in doc["systems"]]
        return head + table(["system", "perplexity", f"vs {base}", "bits/element", "tokens"], rows)
    if kind == "niah":
        lengths = doc["settings"]["lengths"]
        rows = [[x["name"], *(fmt(100 * x["accuracy_by_length"][str(n)] if isinstance(x["accuracy_by_length"], dict)
                                   and str(n) in x["accuracy_by_length"] else None) for n in lengths),
                 fmt(100 * x["accuracy"])] for x in doc["systems"]]
        head = f"{doc['model']}, pass key at {len(doc['settings']['depths'])} depths, accuracy in %\n\n"
        return head + table(["system", *(f"{n} tokens" for n in lengths), "all"], rows)
    if kind == "ruler":
        s = doc["settings"]
        rows = [[x["name"], fmt(x["average"], "{:.1f}"), *(fmt(x["scores"].get(t) if isinstance(x["scores"].get(t),
                (int, float)) else _mean_score(x["scores"].get(t)), "{:.0f}") for t in s["tasks"])]
                for x in doc["systems"]]
        head = (f"{doc['model']}, lengths {s['lengths']}, {s['samples_per_task']} samples per task, seed "
                f"{s['seed']}; scores in %\n\n")
        return head + table(["system", "average", *s["tasks"]], rows)
    if kind == "shadowkv-front":
        return front_table(doc)
    if kind == "shadowkv-ranks":
        rows = [[x["cache"], fmt(sum(x["ranks"]) / len(x["ranks"]), "{:.1f}"), " ".join(map(str, x["ranks"]))]
                for x in doc["systems"]]
        head = (f"{doc['model']}, ranks chosen when one passage of {doc['num_tokens']} tokens compresses "
                "(global layers in order)\n\n")
        return head + table(["setting", "mean rank", "ranks"], rows)
    raise ValueError(f"unknown eval kind {kind}")


def _mean_score(value: Any) -> float | None:
    """A task's score: a number, or a mapping length -> score (averaged)."""
    if isinstance(value, dict) and value:
        numbers = [v for v in value.values() if isinstance(v, (int, float))]
        return sum(numbers) / len(numbers) if numbers else None
    return None


def _swiftkv_evaluate(doc: Document) -> str:
    students = doc["students"]
    teacher = next(iter(students.values()))["teacher_ppl"]
    rows = [[name, fmt(q["student_ppl"], "{:.2f}"), fmt(q["kl"], "{:.3f}"), fmt(100 * q["top1_agreement"], "{:.1f}%")]
            for name, q in students.items()]
    head = (f"{doc['model']} (teacher perplexity {teacher:.2f}), {doc['windows']} held-out windows of "
            f"{doc['context']} tokens\n\n")
    return head + table(["student", "perplexity", "KL(teacher || student)", "top-1 agreement"], rows)


def _early_exit(doc: Document) -> str:
    s, speed = doc["settings"], doc["decode_tokens_per_s"]
    agree = doc["agreement_above_threshold"]
    rows = [
        ["decode tokens at or above the threshold (nothing exiting)",
         f"{100 * doc['share_at_or_above_threshold']:.1f}% of {doc['decode_tokens_observed']}"],
        ["early argmax = final argmax among them", "-" if agree is None else f"{100 * agree:.1f}%"],
        ["early argmax = final argmax, all decode tokens", f"{100 * doc['agreement_all_tokens']:.1f}%"],
        ["exit rate with exits on", f"{100 * doc['exit_rate']:.1f}%"],
        ["identical greedy outputs", f"{doc['identical_outputs']} of {doc['prompts']}"],
        ["tokens agreeing before the first divergence (mean)", f"{doc['tokens_before_first_divergence_mean']:.1f}"],
        ["decode tokens/s, batch 1, with / without",
         f"{speed['with']:.1f} / {speed['without']:.1f} ({doc['decode_speedup']:.2f}x)"],
    ]
    head = (f"{doc['model']} + `{doc['swiftkv']}`, threshold {s['threshold']}, {doc['prompts']} held-out prompts "
            f"of {s['prompt_tokens']} tokens, {s['max_tokens']} greedy tokens each\n\n")
    return head + table(["", "measured"], rows)


def _vllm_prefill(doc: Document) -> str:
    c = doc["config"]
    rows = [[name, fmt(doc[name]["median_tokens_per_s"], "{:.0f}"), fmt(doc[name]["median_s"], "{:.2f}"),
             doc[name]["capacity"]["kv_cache_layers"], str(doc[name]["capacity"]["kv_sharing_fast_prefill"]).lower()]
            for name in ("base", "swiftkv")]
    head = (f"vLLM {doc['versions']['vllm']} ({'torch.compile' if c['compile'] else 'eager'}), offline "
            f"`LLM.generate`, {c['prompts']} prompts of {c['prompt_tokens']} tokens, 1 output token, "
            f"{c['threads']} threads, medians of {c['repeats']}: SwiftKV **{doc['speedup']:.2f}x**\n\n")
    return head + table(["model", "prompt tokens/s", "seconds", "KV layers", "fast prefill"], rows)


def _overlap_probe(doc: Document) -> str:
    """benchmarks/overlap_probe.py: each decode kernel in cache and streamed, with the read probe."""
    rows = [[r["case"], fmt(r["cache_ms"], "{:.2f}"), fmt(r["stream_ms"], "{:.2f}"), fmt(r["memory_ms"], "{:.2f}"),
             fmt(r["stream_ms"] / r["cache_ms"], "{:.2f}"), fmt(r["overlap"], "{:.2f}")] for r in doc["rows"]]
    head = (f"{doc['threads']} threads, medians of {doc['rounds']} alternated rounds; read bandwidth "
            f"{doc['read_gbps']:.1f} GB/s (median of the rounds' probes); load average "
            f"{', '.join(f'{x:.2f}' for x in doc['load_before'])} before; "
            "overlap 1: the streamed run costs max(in cache, memory), 0: their sum\n\n")
    return head + table(["kernel", "in cache ms", "streamed ms", "memory ms", "streamed / in cache", "overlap"], rows)


def _demo(doc: Document) -> str:
    rows = [[r["system"], fmt(r["kv_bytes_per_sequence"] / 2**20, "{:.1f}"), fmt(r["prefill_seconds"], "{:.2f}"),
             fmt(r["decode_tokens_per_s"], "{:.1f}"), r["answer_start"].replace("|", "\\|")] for r in doc["rows"]]
    head = f"{doc['model']}, one held-out prompt of {doc['prompt_tokens']} tokens, {doc['max_tokens']} greedy tokens\n\n"
    return head + table(["system", "KV MiB per sequence", "prefill s", "decode tok/s", "answer begins"], rows)


def _budgets(doc: Document) -> str:
    """The SwiftKV paper's memory-constrained table: systems as rows, KV budgets as columns,
    each cell the headline, the ratio to the first system and the sequences run at once."""
    headline, systems = doc["headline_metric"], doc["systems"]
    first = systems[0]
    rows = []
    for system in systems:
        cells = []
        for index, run in enumerate(system["runs"]):
            ratio = run[headline] / first["runs"][index][headline]
            cells.append(f"{fmt(run[headline], '{:.0f}')} ({fmt(ratio, '{:.2f}')}x, {run['peak_concurrent_sequences']} seqs)")
        rows.append([system["name"], fmt(system.get("kv_bytes_per_token"), "{:.0f}"), *cells,
                     fmt(system.get("repeat_spread"), "{:.2f}")])
    s = doc["settings"]
    head = (f"{doc['model']} {doc['dtype']}, {_where(doc)}; {s['num_requests']} requests of {s['input_len']} + "
            f"{s['output_len']} tokens, admission {s['admission']}. Each cell: {headline.replace('_', ' ')} "
            f"(relative to {first['name']}, peak sequences at once)\n\n")
    budgets = [f"KV budget {b / 2**20:.0f} MiB" for b in doc["kv_budgets"]]
    return head + table(["system", "KV bytes/token", *budgets, "repeat spread"], rows)


def _gpu_check(doc: Document) -> str:
    """gpu-check's own table, as the command prints it (one row per method x model x size)."""
    from kvforge.tools.gpu_check.report import format_table

    return "```\n" + format_table(doc) + "\n```"


def _gpu_check_seeds(doc: Document) -> str:
    """gpu-check's lossy rows over several prompt seeds: floor ratio, draws, error ratio."""
    env = doc["environment"]
    head = (f"{env['device_name']}, torch {env['torch']}; the rounding floor from {doc['floor_rule']}; "
            f"verdicts as judged then (limit {doc['limit']:g}x the floor)\n\n")
    rows = [[str(r["prompt_seed"]), r["row"], fmt(r["floor_ratio"], "{:.2f}"), str(r.get("floor_draws") or 1),
             fmt(r["error_ratio"], "{:.3f}"), "pass" if r["passed"] else "FAIL"] for r in doc["rows"]]
    return head + table(["prompt seed", "row", "x floor", "draws", "err/ref", "verdict"], rows)


RENDERERS: dict[str, Callable[[Document], str]] = {
    "bench prefill": _bench, "bench decode": _bench, "bench throughput": _bench, "bench prefix": _bench,
    "bench serve": _serve, "bench soak": _soak, "bench vllm_swiftkv_prefill": _vllm_prefill, "bench throughput_budgets": _budgets,
    "bench overlap_probe": _overlap_probe,
    "eval ppl": _eval, "eval niah": _eval, "eval ruler": _eval, "eval shadowkv-front": _eval,
    "eval shadowkv-ranks": _eval,
    "swiftkv evaluate": _swiftkv_evaluate, "swiftkv early-exit": _early_exit,
    "demo": _demo, "gpu-check": _gpu_check, "gpu-check-seeds": _gpu_check_seeds,
}


def render_document(path: str, doc: Document) -> str:
    kind = kind_of(doc)
    title = Path(path).stem.replace("_", " ")
    return f"### {title} ({kind})\n\n{RENDERERS[kind](doc)}\n\n{provenance_line(path, doc)}\n"
