"""Per-rate summaries of a serving run: throughput, latency percentiles, goodput, the
server's own concurrency and step split.

Percentiles are linear interpolation between order statistics (numpy's default). Latencies
are reported in milliseconds. Goodput: completed requests per second whose TTFT and TPOT
both meet the SLO (a missing SLO bound always passes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvforge.errors import ConfigError
from kvforge.tools.bench.serve_client import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class SLO:
    """Seconds; None: no bound."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """`ttft=2,tpot=0.1` (seconds, or with an `ms` suffix: `tpot=100ms`)."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for piece in text.split(","):
            key, sep, raw = piece.strip().partition("=")
            if not sep or key not in SLO_KEYS:
                raise ConfigError("slo", piece, f"each entry must be KEY=SECONDS with KEY one of {list(SLO_KEYS)}")
            try:
                value = float(raw[:-2]) / 1000 if raw.endswith("ms") else float(raw.removesuffix("s"))
            except ValueError:
                raise ConfigError("slo", piece, "the bound must be a number of seconds, or ms with 'ms'") from None
            if value <= 0:
                raise ConfigError("slo", piece, "the bound must be > 0")
            values[key] = value
        return cls(**values)

    def met(self, record: RequestRecord) -> bool:
        tpot = record.tpot_s
        return (record.ok
                and (self.ttft is None or (record.ttft_s is not None and record.ttft_s <= self.ttft))
                and (self.tpot is None or tpot is None or tpot <= self.tpot)
                and (self.e2e is None or record.latency_s <= self.e2e))

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e}


def distribution_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    data = np.asarray(values, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(data, PERCENTILES)
    return {"mean": float(data.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(records: Sequence[RequestRecord], seconds: float, slo: SLO) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    per_second = (lambda amount: amount / seconds) if seconds > 0 else (lambda amount: 0.0)
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": seconds,
        "request_throughput": per_second(len(done)),
        "output_token_throughput": per_second(output),
        "total_token_throughput": per_second(prompt + output),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "goodput": per_second(sum(1 for r in done if slo.met(r))),
        # mean requests in flight on the client's side (Little's law over the run)
        "client_concurrency": per_second(sum(r.latency_s for r in done)),
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.latency_s for r in done]),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def step_split(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """From two scrapes of a kvforge server's /metrics: per step kind, the steps timed in
    between and the milliseconds per step of each part (None without --step-timing)."""
    out: dict[str, Any] = {}
    for kind in ("decode", "prefill"):
        steps = after.get(f"steps:{kind}", 0.0) - before.get(f"steps:{kind}", 0.0)
        if steps <= 0:
            continue
        parts = {part: (after.get(f"{kind}:{part}", 0.0) - before.get(f"{kind}:{part}", 0.0)) / steps * 1e3
                 for part in ("linear", "attention", "sampling", "other")}
        out[kind] = {"steps": int(steps), "ms_per_step": sum(parts.values()), "ms_by_part": parts}
    return out or None


# What each repeat of a rate keeps in the JSON beside the pooled summary.
RUN_KEYS = ("completed", "failed", "duration_s", "request_throughput", "output_token_throughput", "ttft_ms",
            "itl_ms", "tpot_ms")


def median_of_runs(runs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The headline figures of a rate as medians over its repeats (None if any repeat lacks one)."""
    picks = {"ttft_ms_median": lambda r: r["ttft_ms"]["median"], "ttft_ms_p90": lambda r: r["ttft_ms"]["p90"],
             "itl_ms_median": lambda r: r["itl_ms"]["median"], "tpot_ms_median": lambda r: r["tpot_ms"]["median"],
             "output_token_throughput": lambda r: r["output_token_throughput"] if r["completed"] else None}
    out: dict[str, float | None] = {}
    for key, pick in picks.items():
        values = [pick(run) for run in runs]
        out[key] = float(np.median(values)) if values and all(v is not None for v in values) else None
    throughputs = [run["output_token_throughput"] for run in runs if run["completed"]]
    out["output_token_throughput_spread"] = max(throughputs) / min(throughputs) \
        if len(throughputs) > 1 and min(throughputs) > 0 else None
    return out
