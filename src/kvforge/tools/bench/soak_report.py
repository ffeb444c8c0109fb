"""The output of `kvforge bench soak`: a short text summary ending in the verdict, the
JSON document (standard JSON: a value that is not a finite number is written as null),
and a plot of resident memory, KV bytes and requests in flight over time."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MIB = float(1 << 20)
SATURATED_NOTE = 0.2  # above this fraction of samples at the in-flight cap, the summary says so


def finite(value: Any) -> Any:
    """`value` with every NaN or infinity (in any nesting of dicts, lists and tuples) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(finite(result), indent=2, allow_nan=False) + "\n"


def write_soak_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(result))


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f} MiB"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _drift_text(drift: dict[str, Any]) -> str:
    ratio = drift["ratio"]
    return (f"{_ms(drift['first_p99_ms'])} -> {_ms(drift['last_p99_ms'])}"
            + ("" if ratio is None else f" (x{ratio:.2f})"))


def format_soak(result: dict[str, Any]) -> str:
    settings, tally, memory = result["settings"], result["counts"], result["memory"]
    drained = result["kv_after_drain"]
    lines = [f"soak: {result['model']}{' + SwiftKV ' + result['swiftkv'] if result.get('swiftkv') else ''} "
             f"[{result['cache']}] {result['dtype']}, {result['threads']} threads; {settings['duration_s']:g} s at "
             f"{settings['request_rate']:g} req/s (seed {settings['seed']}), at most {settings['max_in_flight']} "
             f"in flight; traffic ended after {result['traffic_s']:.1f} s",
             f"requests: {tally['sent']} sent: {tally['served']} served, {tally['refused']} refused as expected, "
             f"{tally['disconnected']} disconnected by the client, {tally['server_error']} 5xx, "
             f"{tally['unexpected']} unexpected"
             + (f"; {tally['skipped']} not sent: the cap on requests in flight held them past the duration "
                "(the server fell behind)" if tally["skipped"] else "")]
    growth = memory["growth"]
    lines.append(f"resident memory: {_mib(memory['reference_rss_bytes'])} (median, second fifth) -> "
                 f"{_mib(memory['final_rss_bytes'])} (last fifth)"
                 + ("" if growth is None else f": {growth:+.2%} (limit {memory['limit']:.0%})"))
    kv = drained["kv_bytes"]
    lines.append(f"KV bytes in use after the drain: {'-' if kv is None else f'{kv:.0f}'}"
                 + ("" if drained["seconds_after_traffic"] is None else
                    f" ({drained['seconds_after_traffic'] - result['traffic_s']:.1f} s after the traffic ended)"))
    drift = result["latency_drift"]
    lines.append(f"p99 latency per output token, first fifth -> last fifth: {_drift_text(drift['per_output_token'])}")
    lines.extend(f"  {kind}: p99 {_drift_text(value)}" for kind, value in drift["per_kind"].items())
    lines.extend(f"  example: {example}" for example in tally["examples"])
    if result["saturated_fraction"] > SATURATED_NOTE or tally["skipped"]:
        lines.append(f"note: the server fell behind: {result['saturated_fraction']:.0%} of the samples had "
                     f"{settings['max_in_flight']} requests in flight (the cap); memory then grows with the load, "
                     "so judge a leak from a run at a --request-rate the server sustains")
    lines.append("PASS" if result["passed"] else "FAIL")
    lines.extend(f"FAIL: {reason}" for reason in result["failures"])
    return "\n".join(lines)


def plot_soak(result: dict[str, Any], path: Path) -> None:
    """Three panels over the seconds since the traffic started: resident memory (with the
    two medians compared), KV bytes in use, and requests in flight (client) beside the
    server's running and waiting requests; the drain after the dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"] + result["drain_samples"]
    times = [s["t_s"] for s in samples]

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [math.nan if s[key] is None else s[key] / scale for s in samples]

    figure, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    traffic_s, memory = result["traffic_s"], result["memory"]
    axes[0].plot(times, series("rss_bytes", MIB), color="#1f77b4", label="server RSS")
    fifth = traffic_s / 5
    for which, key in ((1, "reference_rss_bytes"), (4, "final_rss_bytes")):
        if memory[key] is not None:
            axes[0].hlines(memory[key] / MIB, which * fifth, (which + 1) * fifth, colors="#d62728",
                           label="median of the fifth" if which == 1 else None)
    axes[0].axvspan(0, fifth, color="0.9", label="warm-up")
    axes[0].set_ylabel("resident memory (MiB)")
    axes[1].plot(times, series("kv_bytes", MIB), color="#2ca02c")
    axes[1].set_ylabel("KV bytes in use (MiB)")
    axes[2].plot(times, series("in_flight"), color="#ff7f0e", label="client: in flight")
    axes[2].plot(times, series("running"), color="#9467bd", label="server: running")
    axes[2].plot(times, series("waiting"), color="#8c564b", label="server: waiting")
    axes[2].set_ylabel("requests")
    axes[2].set_xlabel("seconds since the traffic started")
    for axis in axes:
        axis.axvline(traffic_s, color="k", linestyle=":", linewidth=1)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    settings = result["settings"]
    verdict = "PASS" if result["passed"] else "FAIL: " + "; ".join(result["failures"])
    figure.suptitle(f"kvforge bench soak: {result['model']} [{result['cache']}] {result['dtype']}, "
                    f"{result['threads']} threads, {settings['request_rate']:g} req/s for {settings['duration_s']:g} s"
                    f"\n{verdict[:150]}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
