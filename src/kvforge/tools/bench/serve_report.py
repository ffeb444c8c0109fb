"""The output of `kvforge bench serve`: one table row per system and rate, the JSON
document (per-request records included) and a plot of latency percentiles and throughput
against the request rate."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvforge.tools.bench.common import log
from kvforge.tools.bench.report import machine_line

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def _rate_label(rate: float | str) -> str:
    """A request rate as shown; JSON holds an infinite rate as the string "inf"."""
    return str(rate) if isinstance(rate, str) else "inf" if math.isinf(rate) else f"{rate:g}"


def _cell(value: Any, pattern: str = "{:.1f}") -> str:
    return "-" if value is None else pattern.format(value)


def decode_step_split(rate: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """The decode-step split of one rate's run, with its parts as "name ms, ...", if measured."""
    split = (rate.get("step_split") or {}).get("decode")
    if not split:
        return []
    return [(split, ", ".join(f"{k} {v:.1f}" for k, v in split["ms_by_part"].items()))]


def _header(result: dict[str, Any]) -> str:
    settings = result["settings"]
    model = f"{result['model']}{' + SwiftKV ' + result['swiftkv'] if result.get('swiftkv') else ''} {result['dtype']}"
    started = f", {result['threads']} threads, KV budget {settings['kv_budget']}" if result.get("threads") else ""
    if result.get("workload") == "chat":
        chat = settings["chat"]
        return (f"serve (chat): {model}{started}; {settings['repeats']} conversation(s) of {chat['turns']} turns over "
                f"a {chat['shared_prefix']}-token document, {chat['question_len']}-token questions, "
                f"{chat['reply_len']}-token replies")
    return (f"serve: {model}{started}; {settings['num_prompts']} requests per rate x {settings.get('repeats', 1)} "
            f"run(s), input {settings['input_len']}, output {settings['output_len']} tokens")


def format_serve_table(result: dict[str, Any]) -> str:
    if result.get("workload") == "chat":
        return _format_chat_table(result)
    lines = [_header(result)]
    header = ("system", "rate", "done", "fail", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
              "TPOT p99", "ITL p50", "E2E p50", "goodput", "running", "preempt")
    rows = [header]
    for system in result["systems"]:
        for rate in system["rates"]:
            rows.append((system["name"], _rate_label(rate["request_rate"]), str(rate["completed"]), str(rate["failed"]),
                         f"{rate['request_throughput']:.3f}", f"{rate['output_token_throughput']:.1f}",
                         _cell(rate["ttft_ms"]["median"]), _cell(rate["ttft_ms"]["p99"]),
                         _cell(rate["tpot_ms"]["median"]), _cell(rate["tpot_ms"]["p99"]),
                         _cell(rate["itl_ms"]["median"]), _cell(rate["e2e_ms"]["median"]),
                         f"{rate['goodput']:.3f}",
                         _cell(rate.get("server_running_mean"), "{:.1f}") + "/" + _cell(rate.get("server_running_max"), "{:.0f}"),
                         _cell(rate.get("preemptions"), "{}")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines.append("latencies in ms (client clock); running = server requests running, mean/max; goodput in req/s")
    for system in result["systems"]:
        for rate in system["rates"]:
            for split, parts in decode_step_split(rate):
                lines.append(f"{system['name']} @ {_rate_label(rate['request_rate'])}: decode step "
                             f"{split['ms_per_step']:.1f} ms over {split['steps']} steps ({parts})")
            for error in rate.get("errors", []):
                lines.append(f"{system['name']} @ {_rate_label(rate['request_rate'])}: error: {error}")
    lines += profile_lines(result["systems"])
    for name, by_rate in result.get("peer_ratios", {}).items():
        for rate, ratios in by_rate.items():
            lines.append(f"{result['systems'][0]['name']} vs {name} @ {rate} req/s (> 1: {result['systems'][0]['name']} "
                         f"better; medians of runs): " + ", ".join(f"{key} {_cell(value, '{:.2f}')}x"
                                                                 for key, value in ratios.items()))
    for name, value in result["ratios"].items():
        if value is not None:
            lines.append(f"median TTFT at {_rate_label(result['systems'][0]['rates'][0]['request_rate'])} req/s: "
                         f"{name} / {result['systems'][0]['name']} = {value:.2f}x")
    for name, value in result["throughput_ratios_at_highest_rate"].items():
        if value is not None:
            lines.append(f"request throughput at {_rate_label(result['systems'][0]['rates'][-1]['request_rate'])} "
                         f"req/s: {result['systems'][0]['name']} / {name} = {value:.2f}x")
    return "\n".join(lines + _footer(result))


def profile_lines(systems: list[dict[str, Any]]) -> list[str]:
    """--profile-servers: each server's CPU time per engine step by part (py-spy samples)."""
    lines = []
    for system in systems:
        profile = system.get("profile")
        if not profile:
            continue
        unit = "CPU-thread ms per engine step" if profile["engine_steps"] else "share of samples"
        parts = ", ".join(f"{name} {part['ms_per_step']:.1f}" if profile["engine_steps"] else
                          f"{name} {part['share']:.0%}" for name, part in profile["parts"].items() if part["samples"])
        steps = f", {profile['engine_steps']} steps" if profile["engine_steps"] else ""
        lines.append(f"{system['name']}: where its CPU time went ({unit}, {profile['samples']} py-spy samples"
                     f"{steps}): {parts}")
    return lines


def _footer(result: dict[str, Any]) -> list[str]:
    return [machine_line(result["environment"], []),
            *(f"WARNING: {flag['message']}" for flag in result.get("flags", []))]


def _format_chat_table(result: dict[str, Any]) -> str:
    turns = result["settings"]["chat"]["turns"]
    rows = [("system", "turn 1 TTFT", f"turns 2-{turns} TTFT", "failed", "per conversation (turn 1 / later)")]
    for system in result["systems"]:
        chat = system["chat"]
        runs = "; ".join(f"{_cell(run['first_turn_ttft_ms'], '{:.0f}')}/{_cell(run['later_turns_mean_ttft_ms'], '{:.0f}')}"
                         for run in chat["runs"])
        rows.append((system["name"], _cell(chat["first_turn_ttft_ms"]), _cell(chat["later_turns_mean_ttft_ms"]),
                     str(chat["failed"]), runs))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [_header(result)]
    lines += ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines.append("TTFT in ms (client clock), medians over conversations")
    lines += profile_lines(result["systems"])
    first = result["systems"][0]["name"]
    for name, ratios in result.get("peer_ratios", {}).items():
        lines.append(f"{first} vs {name} (> 1: {first} answers sooner): turn 1 "
                     f"{_cell(ratios['first_turn_ttft_ms'], '{:.2f}')}x, later turns "
                     f"{_cell(ratios['later_turns_mean_ttft_ms'], '{:.2f}')}x")
    return "\n".join(lines + _footer(result))


def standard_json(value: Any) -> Any:
    """`value` with every float JSON cannot hold replaced: inf -> "inf" (a request rate), NaN -> None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: standard_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [standard_json(item) for item in value]
    return value


def write_serve_outputs(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(standard_json(result), indent=2, allow_nan=False) + "\n")
    if result.get("workload") == "chat":
        log(f"wrote {path}")
        return
    png = path.with_suffix(".png")
    plot_serve(result, png)
    log(f"wrote {path} and {png}")


def plot_serve(result: dict[str, Any], path: Path) -> None:
    """TTFT, TPOT and end-to-end latency (median solid, p99 dashed) and request throughput
    against the request rate; `inf` is the last position on the categorical x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["request_rate"] for r in result["systems"][0]["rates"]]
    positions = list(range(len(rates)))
    figure, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2e_ms", "end-to-end latency (ms)")]
    for index, system in enumerate(result["systems"]):
        colour = COLOURS[index % len(COLOURS)]
        by_rate = system["rates"]
        for axis, (key, label) in zip(axes, panels):
            axis.plot(positions, [r[key]["median"] for r in by_rate], "o-", color=colour,
                      label=f"{system['name']} p50")
            axis.plot(positions, [r[key]["p99"] for r in by_rate], "s--", color=colour, alpha=0.6,
                      label=f"{system['name']} p99")
            axis.set_title(label, fontsize=10)
        axes[3].plot(positions, [r["request_throughput"] for r in by_rate], "o-", color=colour, label=system["name"])
    axes[3].set_title("request throughput (req/s)", fontsize=10)
    for axis in axes:
        axis.set_xticks(positions)
        axis.set_xticklabels([_rate_label(r) for r in rates])
        axis.set_xlabel("request rate (req/s)")
        axis.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[3].legend(fontsize=7)
    settings = result["settings"]
    figure.suptitle(f"kvforge bench serve: {result['model']} {result['dtype']}, {result['threads']} threads, "
                    f"{settings['num_prompts']} requests per rate, input {settings['input_len']}, output "
                    f"{settings['output_len']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
