"""`kvforge bench throughput --kv-budget A,B,...`: the same throughput run under several KV
budgets, in the shape of the SwiftKV paper's memory-constrained table (systems as rows,
budgets as columns).

Each budget runs every kvforge system afresh (its own cache of that size; the weights are
loaded once). A small budget limits how many sequences run at once, so memory decides the
throughput; a large one lets compute decide. Machine peaks and the load probe cover the
whole command.

JSON layout: benchmark "throughput_budgets", model, dtype, device, threads, settings,
headline_metric, kv_budgets [bytes], systems [{name, kind, kv_bytes_per_token,
runs [{kv_budget, <bench throughput's metrics of one system>}]}] (systems[0] is the one
under test), ratios {budget: {name: headline(systems[0]) / headline(name)}}, peak,
environment, flags, trustworthy, provenance. `--json OUT` also writes OUT.png.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvforge.sizes import format_bytes
from kvforge.tools.bench.common import BenchContext, log
from kvforge.tools.bench.machine_load import LoadProbe, flags
from kvforge.tools.bench.measure import finish_measuring, measure_systems, start_measuring, timed_runs
from kvforge.tools.bench.report import machine_line
from kvforge.tools.report.provenance import provenance

BENCHMARK = "throughput_budgets"


def run_budgets(ctx: BenchContext, runner: Callable[[BenchContext, Any], dict[str, Any]],
                headline: Callable[[dict[str, Any]], None], settings: dict[str, Any]) -> dict[str, Any]:
    """Every system under every budget in `ctx.kv_budgets`; `headline(run)` adds the
    headline and its companions to one system's run."""
    start_measuring(ctx)
    runs: dict[str, list[dict[str, Any]]] = {system.name: [] for system in ctx.systems}
    kinds = {system.name: system.kind for system in ctx.systems}
    for budget in ctx.kv_budgets:
        ctx.kv_budget = budget
        log(f"KV budget {format_bytes(budget)}")
        for result in measure_systems(ctx, {"kvforge": runner}):
            headline(result)
            runs[result.pop("name")].append({"kv_budget": budget, **{k: v for k, v in result.items() if k != "kind"}})
    finish_measuring(ctx)
    systems = [{"name": name, "kind": kinds[name], "kv_bytes_per_token": entries[0].get("kv_bytes_per_token"),
                "runs": entries} for name, entries in runs.items()]
    return finish_budgets(ctx, settings, systems)


def budget_ratios(systems: Sequence[dict[str, Any]], headline: str) -> dict[str, dict[str, float]]:
    """Per budget (its byte count as text): systems[0]'s headline over each other system's."""
    out: dict[str, dict[str, float]] = {}
    ours = systems[0]["runs"]
    for index, run in enumerate(ours):
        out[str(run["kv_budget"])] = {
            s["name"]: (run[headline] / s["runs"][index][headline] if s["runs"][index][headline] > 0 else math.inf)
            for s in systems[1:]}
    return out


def finish_budgets(ctx: BenchContext, settings: dict[str, Any], systems: list[dict[str, Any]],
                   headline: str = "total_tokens_per_s") -> dict[str, Any]:
    spreads = []
    for system in systems:
        for run in system["runs"]:  # max/min of the timed repeats, as bench.report.finish
            times = run.get("seconds_all") or [run["seconds"]]
            run["repeat_spread"] = max(times) / min(times) if min(times) > 0 else math.inf
            spreads.append(run["repeat_spread"])
        system["repeat_spread"] = max(run["repeat_spread"] for run in system["runs"])
    load = (ctx.probe or LoadProbe()).report()
    result = {
        "benchmark": BENCHMARK, "model": ctx.args.model, "dtype": str(ctx.dtype).removeprefix("torch."),
        "device": ctx.device, "threads": ctx.args.threads, "settings": settings, "headline_metric": headline,
        "kv_budgets": list(ctx.kv_budgets), "systems": systems, "ratios": budget_ratios(systems, headline),
        "peak": ctx.peak.as_dict() if ctx.peak is not None else None,
        "environment": {"torch": torch.__version__, **load},
        "flags": flags(load, timed_runs(ctx.args), max(spreads)),
        "provenance": provenance(ctx.args),
    }
    result["trustworthy"] = not result["flags"]
    print(format_budget_table(result))
    if ctx.args.json:
        path = Path(ctx.args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        plot_budgets(result, path.with_suffix(".png"))
        log(f"wrote {path} and {path.with_suffix('.png')}")
    return result


def format_budget_table(result: dict[str, Any]) -> str:
    """Systems as rows, budgets as columns: headline (peak concurrent sequences), then each
    system's headline relative to the first system's under the same budget."""
    headline, systems = result["headline_metric"], result["systems"]
    budgets = [format_bytes(b) for b in result["kv_budgets"]]
    width = max(len("system"), *(len(s["name"]) for s in systems)) + 2
    cell = max(16, *(len(b) + 2 for b in budgets))
    lines = [f"{BENCHMARK}: {result['model']} {result['dtype']}, {result['threads']} threads; {headline} "
             "(peak concurrent sequences) per KV budget",
             "system".ljust(width) + "KV B/token".rjust(12) + "".join(b.rjust(cell) for b in budgets)]
    for system in systems:
        cells = [f"{run[headline]:.1f} ({run['peak_concurrent_sequences']})".rjust(cell) for run in system["runs"]]
        lines.append(system["name"].ljust(width) + f"{system['kv_bytes_per_token'] or 0:.0f}".rjust(12) + "".join(cells))
    first = systems[0]["name"]
    for system in systems[1:]:
        ratios = [result["ratios"][str(b)][system["name"]] for b in result["kv_budgets"]]
        lines.append(f"{first} / {system['name']}: " + ", ".join(f"{r:.2f}x" for r in ratios))
    lines.append(machine_line(result["environment"], systems))
    lines.extend(f"WARNING: {flag['message']}" for flag in result["flags"])
    return "\n".join(lines)


def plot_budgets(result: dict[str, Any], path: Path) -> None:
    """Left: the headline against the budget, one line per system; right: the peak number
    of sequences running at once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvforge.tools.bench.plot import COLOURS

    mib = [b / 2**20 for b in result["kv_budgets"]]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, system in enumerate(result["systems"]):
        style = dict(color=COLOURS[index % len(COLOURS)], marker="o", label=system["name"])
        axes[0].plot(mib, [run[result["headline_metric"]] for run in system["runs"]], **style)
        axes[1].plot(mib, [run["peak_concurrent_sequences"] for run in system["runs"]], **style)
    for axis, label in zip(axes, (result["headline_metric"], "peak concurrent sequences")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("KV budget (MiB)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    settings = result["settings"]
    figure.suptitle(f"kvforge bench throughput under KV budgets: {result['model']} {result['dtype']}, "
                    f"{result['threads']} threads; {settings['num_requests']} requests x "
                    f"{settings['input_len']} + {settings['output_len']} tokens", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
