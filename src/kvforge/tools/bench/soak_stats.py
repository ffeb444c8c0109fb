"""What a soak concludes from its records and samples, and its verdicts.

- Memory growth: the run is cut into fifths of the traffic's duration; the first is
  warm-up (caches, allocator pools, compiled kernels fill up there). Growth = median
  resident memory of the last fifth / that of the second fifth - 1; a server that leaks
  per request grows with the requests served, a healthy one stays flat after warm-up.
- KV back to 0: once the traffic has stopped and the server has drained, no request holds
  KV-cache bytes, so the gauge must read 0 (every tier).
- Latency drift: p99 end-to-end latency of the first fifth of requests (in send order)
  against the last fifth, per request kind and normalised per output token; reported, not
  judged (a loaded machine moves it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvforge.tools.bench.soak_client import OUTCOMES, SoakRecord

RSS_GROWTH_LIMIT = 0.05  # growth at or above it fails


@dataclass(frozen=True)
class Sample:
    """One look at the server, `t_s` seconds after the traffic started."""

    t_s: float
    rss_bytes: int | None
    kv_bytes: float | None  # kvforge_kv_cache_bytes_used summed over tiers; None: no /metrics
    running: float | None
    waiting: float | None
    in_flight: int  # requests open on the client's side

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fifth(values: Sequence[Any], which: int) -> list[Any]:
    """The `which`-th (0-4) fifth of a sequence by position."""
    n = len(values)
    return list(values[which * n // 5:(which + 1) * n // 5])


def rss_growth(samples: Sequence[Sample], traffic_s: float) -> dict[str, Any]:
    """Median RSS of the second and the last fifth of [0, traffic_s]; growth None when
    either fifth holds no sample."""
    def median_in(low: float, high: float) -> float | None:
        values = [s.rss_bytes for s in samples if low <= s.t_s < high and s.rss_bytes is not None]
        return float(np.median(values)) if values else None

    step = traffic_s / 5
    reference, final = median_in(step, 2 * step), median_in(4 * step, traffic_s + 1e-9)
    growth = final / reference - 1 if reference and final is not None else None
    return {"warmup_s": step, "reference_rss_bytes": reference, "final_rss_bytes": final, "growth": growth,
            "limit": RSS_GROWTH_LIMIT}


def _p99_ms(values: Sequence[float]) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), 99) * 1e3) if values else None


def _drift(first: Sequence[float], last: Sequence[float]) -> dict[str, Any]:
    p_first, p_last = _p99_ms(first), _p99_ms(last)
    return {"first_p99_ms": p_first, "last_p99_ms": p_last, "requests": [len(first), len(last)],
            "ratio": p_last / p_first if p_first and p_last is not None else None}


def latency_drift(records: Sequence[SoakRecord]) -> dict[str, Any]:
    """p99 latency, first fifth vs last fifth of the requests of each kind (in send order),
    for the answered ones (served or refused); and per output token over all served ones."""
    answered = sorted((r for r in records if r.outcome in ("served", "refused") and r.latency_s is not None),
                      key=lambda r: r.sent_s)
    per_kind = {}
    for kind in sorted({r.kind for r in answered}):
        latencies = [r.latency_s for r in answered if r.kind == kind]
        per_kind[kind] = _drift(fifth(latencies, 0), fifth(latencies, 4))
    per_token = [r.latency_s / max(r.output_tokens, 1) for r in answered if r.outcome == "served"]
    return {"per_kind": per_kind, "per_output_token": _drift(fifth(per_token, 0), fifth(per_token, 4))}


def counts(records: Sequence[SoakRecord]) -> dict[str, Any]:
    by_outcome = {outcome: sum(1 for r in records if r.outcome == outcome) for outcome in OUTCOMES}
    by_kind: dict[str, dict[str, int]] = {}
    for record in records:
        by_kind.setdefault(record.kind, dict.fromkeys(OUTCOMES, 0))[record.outcome] += 1
    odd = [r for r in records if r.outcome in ("server_error", "unexpected")]
    return {"sent": len(records) - by_outcome["skipped"], **by_outcome, "by_kind": by_kind,
            "examples": [f"#{r.index} {r.kind} (expected {r.expect}): status {r.status}: {r.error}" for r in odd[:10]]}


def kv_drained(samples_after: Sequence[Sample]) -> dict[str, Any]:
    """The last look at the server after the traffic stopped: KV bytes and requests left."""
    last = samples_after[-1] if samples_after else None
    return {"kv_bytes": None if last is None else last.kv_bytes,
            "running": None if last is None else last.running,
            "waiting": None if last is None else last.waiting,
            "seconds_after_traffic": None if last is None else last.t_s}


def failures(tally: dict[str, Any], memory: dict[str, Any], drained: dict[str, Any]) -> list[str]:
    """One line per property that fails; empty: the soak passed."""
    out = []
    if tally["server_error"]:
        out.append(f"5xx answers: {tally['server_error']} (must be 0)")
    if tally["unexpected"]:
        out.append(f"unexpected answers: {tally['unexpected']} (must be 0: a bad request answered, a good one "
                   "refused, or no answer)")
    growth = memory["growth"]
    if growth is None:
        out.append("resident memory: not judged: the second or last fifth of the run has no sample")
    elif growth >= RSS_GROWTH_LIMIT:
        out.append(f"resident memory grew {growth:.1%} after warm-up (median of the last fifth vs the second; "
                   f"must be < {RSS_GROWTH_LIMIT:.0%})")
    if drained["kv_bytes"] is None:
        out.append("KV bytes after the drain: not read (no kvforge /metrics)")
    elif drained["kv_bytes"] != 0:
        out.append(f"KV bytes in use after the traffic stopped and the server drained: {drained['kv_bytes']:.0f} "
                   "(must be 0)")
    return out
