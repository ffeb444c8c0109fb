"""The result of a benchmark: ratios, the JSON document, the stdout table, the files.

JSON layout (one document per run):
  benchmark, model, dtype, threads, settings{...}, headline_metric,
  systems[{name, kind, <metrics>}]  (systems[0] is the configuration under test),
  ratio   = headline(systems[0]) / headline(systems[1])  (null with no --compare),
  ratios  = {name: headline(systems[0]) / headline(name)} for every comparison,
  peak{matmul_gflops, read_gbps, ...}, environment{torch, cpu_count, load averages}.
`--json OUT` writes OUT and the plot OUT with a .png suffix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvforge.sizes import format_bytes
from kvforge.tools.bench.common import BenchContext, log
from kvforge.tools.bench.machine_load import LoadProbe, flags
from kvforge.tools.bench.measure import timed_runs
from kvforge.tools.bench.plot import Panel, plot_result
from kvforge.tools.report.provenance import provenance


@dataclass(frozen=True)
class Column:
    key: str  # metric key in a system's dict
    header: str
    fmt: str = "{:.1f}"


def ratios(headline: str, systems: Sequence[dict[str, Any]]) -> tuple[float | None, dict[str, float]]:
    """systems[0]'s headline divided by each other system's (> 1: the one under test is faster)."""
    if len(systems) < 2:
        return None, {}
    ours = float(systems[0][headline])
    out = {s["name"]: (ours / float(s[headline]) if float(s[headline]) > 0 else math.inf) for s in systems[1:]}
    return out[systems[1]["name"]], out


def finish(ctx: BenchContext, benchmark: str, settings: dict[str, Any], headline: str,
           systems: list[dict[str, Any]], columns: Sequence[Column], panel: Panel | None = None,
           bounds: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`bounds`: [{"what", "ratio", "bound", "why"}] that no honest measurement exceeds."""
    for system in systems:  # max/min of the timed repeats: > ~1.1 on this kind of machine means noise
        times = system.get("seconds_all") or [system["seconds"]]
        system["repeat_spread"] = max(times) / min(times) if min(times) > 0 else math.inf
    ratio, all_ratios = ratios(headline, systems)
    load = (ctx.probe or LoadProbe()).report()
    warnings = flags(load, timed_runs(ctx.args), max(s["repeat_spread"] for s in systems), bounds)
    result = {
        "benchmark": benchmark,
        "model": ctx.args.model,
        "weights": ctx.weights,
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "device": ctx.device,
        "threads": ctx.args.threads,
        "settings": settings,
        "headline_metric": headline,
        "systems": systems,
        "ratio": ratio,
        "ratios": all_ratios,
        "peak": ctx.peak.as_dict() if ctx.peak is not None else None,
        "environment": {"torch": torch.__version__, **load, **_accelerator(ctx.device)},
        "bounds": bounds or [],
        "flags": warnings,
        "trustworthy": not warnings,
        "provenance": provenance(ctx.args),
    }
    print(format_table(result, columns))
    if ctx.args.json:
        write_outputs(result, Path(ctx.args.json), panel)
    return result


def format_table(result: dict[str, Any], columns: Sequence[Column]) -> str:
    settings = " ".join(f"{k}={v}" for k, v in result["settings"].items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool))
    lines = [f"{result['benchmark']}: {result['model']} {result['dtype']}, {result['threads']} threads; {settings}"]
    if result.get("weights", "checkpoint") != "checkpoint":
        lines.append(f"weights: {result['weights']}: speed only, outputs are meaningless")
    peak = result.get("peak")
    if peak:
        kernel = f" ({peak['matmul_kernel']})" if peak.get("matmul_kernel") else ""
        lines.append(f"measured peak: matmul {peak['matmul_gflops']:.1f} GFLOP/s{kernel}, "
                     f"read {peak['read_gbps']:.1f} GB/s"
                     + (f" (best pass {peak['read_gbps_best']:.1f})" if peak.get("read_gbps_best") else "")
                     + (f"; median before the systems {peak['read_gbps_before']:.1f}, after {peak['read_gbps_after']:.1f}"
                        if peak.get("read_gbps_after") else ""))
    names = [s["name"] for s in result["systems"]]
    width = max(len("system"), *(len(n) for n in names)) + 2
    widths = [max(len(c.header), 10) + 2 for c in columns]
    lines.append("system".ljust(width) + "".join(c.header.rjust(w) for c, w in zip(columns, widths)))
    for system in result["systems"]:
        cells = []
        for column, w in zip(columns, widths):
            value = system.get(column.key)
            cells.append(("-" if value is None else column.fmt.format(value)).rjust(w))
        lines.append(system["name"].ljust(width) + "".join(cells))
    lines.extend(cache_lines(result["systems"]))
    lines.extend(step_split_lines(result["systems"]))
    for name, value in result["ratios"].items():
        lines.append(f"{result['headline_metric']}: {names[0]} / {name} = {value:.3f}x")
    lines.append(machine_line(result["environment"], result["systems"]))
    lines.extend(f"WARNING: {flag['message']}" for flag in result.get("flags", []))
    return "\n".join(lines)


def machine_line(env: dict[str, Any], systems: Sequence[dict[str, Any]]) -> str:
    foreign = env.get("foreign_cores")
    spreads = ", ".join(f"{s['name']} {s['repeat_spread']:.2f}x" for s in systems if "repeat_spread" in s)
    settings = " ".join(f"{k}={v}" for k, v in (env.get("thread_settings") or {}).items())
    return (f"machine: load average {env.get('load_average_before')} before, {env.get('load_average_after')} after; "
            f"other programs used {'?' if foreign is None else f'{foreign:.2f}'} of {env.get('cpu_count')} cores"
            + (f"; thread settings {settings}" if settings else "")
            + (f"; repeat spread (slowest/fastest): {spreads}" if spreads else ""))


def cache_lines(systems: Sequence[dict[str, Any]]) -> list[str]:
    """Per kvforge system: bytes per tier with the prompts in the cache, and the cache's
    hit rate and phase times of the timed part when it reports them (shadowkv)."""
    lines = []
    for system in systems:
        held = system.get("cache_bytes_after_prefill")
        if not held:
            continue
        parts = [f"KV after prefill: fast {format_bytes(held.get('fast', 0))}, slow {format_bytes(held.get('slow', 0))}"]
        stats = system.get("cache_statistics") or {}
        if "chunk_hit_rate" in stats:
            parts.append(f"chunk hit rate {stats['chunk_hit_rate']:.3f}")
        ranks = [stats[f"rank_layer_{i}"] for i in range(len(stats)) if f"rank_layer_{i}" in stats]
        if ranks:  # shadowkv: ranks chosen per compressed layer (means over sequences)
            parts.append(f"ranks per layer {'/'.join(f'{r:.0f}' for r in ranks)} (mean {stats['rank_mean']:.1f})")
        seconds = {k.removeprefix("seconds_"): v for k, v in stats.items() if k.startswith("seconds_") and v}
        if seconds:
            parts.append("s: " + " ".join(f"{k} {v:.2f}" for k, v in seconds.items()))
        lines.append(f"{system['name']}: " + "; ".join(parts))
    return lines


def step_split_lines(systems: Sequence[dict[str, Any]]) -> list[str]:
    """Per system with a step split (`bench throughput`'s kvforge systems): where a decode
    step's time goes, the same for prefill-containing steps, and the attention's achieved
    GB/s and GFLOP/s beside the peaks measured in the run."""
    lines = []
    for system in systems:
        name = system["name"]
        for kind, label in (("decode", "decode step"), ("prefill", "prefill-containing step")):
            if system.get(f"{kind}_ms_per_step") is None:
                continue
            parts = " + ".join(f"{part} {system[f'{kind}_{part}_ms']:.1f}"
                               for part in ("linear", "attention", "sampling", "rest"))
            line = f"{name}: {label} {system[f'{kind}_ms_per_step']:.1f} ms = {parts}"
            if kind == "decode":
                line += f"; {system.get('generated_tokens_per_s', 0.0):.1f} generated tok/s"
            lines.append(line + f" ({system[f'{kind}_steps']} steps)")
        if system.get("attention_gbps") is not None:
            read = system.get("attention_fraction_of_read_bandwidth")
            matmul = system.get("attention_fraction_of_matmul_peak")
            lines.append(f"{name}: attention: {system['attention_gbps']:.2f} GB/s"
                         f" ({'?' if read is None else f'{read:.1%}'} of measured read BW), "
                         f"{system['attention_gflops']:.2f} GFLOP/s"
                         f" ({'?' if matmul is None else f'{matmul:.1%}'} of matmul peak); "
                         f"{format_bytes(round(system['attention_bytes_per_decode_step']))} KV per decode step")
    return lines


def write_outputs(result: dict[str, Any], path: Path, panel: Panel | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    png = path.with_suffix(".png")
    plot_result(result, png, panel)
    log(f"wrote {path} and {png}")


def _accelerator(device: str) -> dict[str, str]:
    """The GPU's name on a CUDA run (the machine line names only the host's CPU)."""
    on = torch.device(device)
    return {"device_name": torch.cuda.get_device_name(on)} if on.type == "cuda" else {}
