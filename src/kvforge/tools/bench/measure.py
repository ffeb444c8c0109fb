"""Measuring the systems of a benchmark: the machine's peaks around them, the rounds, and
the timing rule of every timed run.

Timing rule: each system runs `warmup` untimed times (first-call costs: thread pools,
oneDNN/BLAS kernel selection, first touch of the KV pool), then `repeats` timed times; the
reported run is the one with the median time (the upper median for an even count), so its
other counters belong to the same run. All repeat times are kept in `seconds_all`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvforge.errors import KVForgeError
from kvforge.tools.bench.common import BenchContext, log
from kvforge.tools.bench.systems import System

Runner = Callable[[BenchContext, System], dict[str, Any]]


def run_systems(ctx: BenchContext, runners: Mapping[str, Runner]) -> list[dict[str, Any]]:
    """Measure every system with the runner registered for its kind, freeing between systems."""
    start_measuring(ctx)
    systems = measure_systems(ctx, runners)
    finish_measuring(ctx)
    return systems


def start_measuring(ctx: BenchContext) -> None:
    """Before the first timed region: build every kernel, start the load probe, measure the
    machine's peaks."""
    from kvforge.prebuild import build_cpu_kernels
    from kvforge.tools.bench.machine_load import LoadProbe
    from kvforge.tools.bench.peak import READ_PASSES, measure_peak

    # Every kernel is built before the first timed region (a compile once landed in a timed
    # ShadowKV decode when --warmup 0 left nothing to build it earlier;
    # docs/benchmarks.md#measurements-behind-design-choices).
    kernels, seconds = build_cpu_kernels()
    ready = [name for name, ok in kernels.items() if ok]
    missing = [name for name, ok in kernels.items() if not ok]
    log(f"C++ kernels ready in {seconds:.1f} s: {', '.join(ready) or 'none'}"
        + (f"; PyTorch fallback for: {', '.join(missing)}" if missing else ""))
    ctx.probe = LoadProbe()
    ctx.peak = measure_peak(ctx.dtype, torch.device(ctx.device))
    log(f"matmul peak {ctx.peak.matmul_gflops:.1f} GFLOP/s ({ctx.peak.matmul_dtype}, n={ctx.peak.matmul_size}), "
        f"read bandwidth {ctx.peak.read_gbps:.1f} GB/s"
        + (f" (median of {READ_PASSES} passes; best {ctx.peak.read_gbps_best:.1f})"
           if ctx.peak.read_gbps_best is not None else "")
        + f", on {ctx.peak.device}"
        + (f", {ctx.peak.threads} threads" if ctx.peak.device == "cpu" else ""))


def finish_measuring(ctx: BenchContext) -> None:
    """After the last timed region: the read probe again (CPU), so that the bandwidth the
    systems are compared with is the median of passes taken before and after them
    (peak.with_read_after)."""
    from kvforge.tools.bench.peak import with_read_after

    ctx.peak = with_read_after(ctx.peak)
    if ctx.peak.read_gbps_after is not None:
        log(f"read bandwidth after the systems {ctx.peak.read_gbps_after:.1f} GB/s (before "
            f"{ctx.peak.read_gbps_before:.1f}); compared with: {ctx.peak.read_gbps:.1f} GB/s, the median of "
            f"{len(ctx.peak.read_passes_gbps)} passes")


def measure_systems(ctx: BenchContext, runners: Mapping[str, Runner]) -> list[dict[str, Any]]:
    """Every system, measured by the runner registered for its kind (after `start_measuring`).

    With `--rounds R` > 1 the whole list is measured R times, in reverse order on every other
    round (A B, B A, A B, ...), and each system's rounds are merged (`merge_rounds`). Systems
    measured one after another see whatever the machine does meanwhile; a long command on a
    shared machine drifts (one system's runs in a quiet hour, the next one's in a busy one),
    and alternating spreads that drift over every system alike."""
    for system in ctx.systems:
        if system.kind not in runners:
            raise KVForgeError(f"no runner for system kind {system.kind!r}")
    rounds = timed_rounds(ctx.args)
    per_round: list[dict[str, dict[str, Any]]] = []
    for index in range(rounds):
        order = list(ctx.systems) if index % 2 == 0 else list(reversed(ctx.systems))
        if rounds > 1:
            log(f"round {index + 1}/{rounds}: {', '.join(system.name for system in order)}")
        results = {}
        for system in order:
            metrics = runners[system.kind](ctx, system)
            results[system.name] = {"name": system.name, "kind": system.kind, **metrics}
            gc.collect()  # the runner's engine (KV pool) or transformers model is garbage now
        per_round.append(results)
    return [merge_rounds([results[system.name] for results in per_round]) for system in ctx.systems]


def timed_rounds(args: Any) -> int:
    """`--rounds` (1 where a benchmark has no such argument)."""
    return int(getattr(args, "rounds", 1) or 1)


def timed_runs(args: Any) -> int:
    """Timed runs per system over the whole command: repeats in each of the rounds."""
    return int(args.repeats) * timed_rounds(args)


def merge_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's results from several rounds as one: the counters of the round whose
    chosen run is the median by time (the upper one of an even count, as `repeat_runs`), all
    rounds' repeat times in `seconds_all` (in the order they ran) and the fastest in
    `seconds_min`. Keys that only some rounds measured (bench throughput's step split runs
    in the first round only) are kept from the round that has them."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda run: run["seconds"])
    chosen = ordered[len(ordered) // 2]
    times = [t for run in runs for t in (run.get("seconds_all") or [run["seconds"]])]
    only_some = {key: value for run in runs for key, value in run.items() if key not in chosen}
    return {**only_some, **chosen, "seconds_all": times, "seconds_min": min(times), "rounds": len(runs)}


def repeat_runs(label: str, once: Callable[[], dict[str, Any]], warmup: int, repeats: int) -> dict[str, Any]:
    """Run `once` (which times itself and returns {"seconds": ..., counters...}) warmup +
    repeats times; return the median-time run with `seconds_all`."""
    for index in range(warmup):
        run = once()
        log(f"{label}: warmup {index + 1}/{warmup} {run['seconds']:.3f} s")
    runs = []
    for index in range(repeats):
        run = once()
        runs.append(run)
        log(f"{label}: run {index + 1}/{repeats} {run['seconds']:.3f} s")
    ordered = sorted(runs, key=lambda r: r["seconds"])
    chosen = ordered[len(ordered) // 2]
    # The fastest run too: on a shared machine the gap between median and min shows noise.
    return {**chosen, "seconds_all": [r["seconds"] for r in runs], "seconds_min": ordered[0]["seconds"]}


def rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else float("inf")
