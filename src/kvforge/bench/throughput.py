"""`kvforge bench throughput`: many requests submitted at once, served to completion.

kvforge: all `num_requests` prompts (random ids, `input_len` tokens each, after a shared
system prompt of `--shared-prefix` tokens) are added to the
engine at once (max_tokens=output_len, greedy, ignore_eos), and the engine is stepped until
every request finishes, as `LLM.generate` does (detokenising included). The continuous-
batching scheduler mixes prefill chunks and decode tokens under max_num_batched_tokens;
--kv-budget caps the cache, so a small budget shows up as lower concurrency and preemptions.

transformers: `model.generate` on static batches of --hf-batch prompts (default
min(N, 16)), max_new_tokens = min_new_tokens = output_len, greedy. All prompts have the
same length, so nothing is padded.

Headline: total_tokens_per_s = N * (input_len + output_len) / wall time (its ratio between
two systems equals the generated-tokens/s ratio: same work). Also generated tokens/s, peak
concurrent sequences, preemptions, the peak KV bytes in use, the whole sequences the budget
admits by the cache's accounting, and both counts relative to the system under test.
--admission reserve admits a request only when every running request's prompt + max_tokens
fits the budget (applied to every kvforge system alike; no preemption).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvforge.bench import hf_peer
from kvforge.bench.common import BenchContext, System, drain, prepare, rate, repeat_runs, run_systems
from kvforge.bench.report import Column, Panel, finish
from kvforge.cache.base import CacheMethod
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import KVForgeError, require

HEADLINE = "total_tokens_per_s"


def _kvforge(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    prompts = ctx.prompts(args.num_requests, args.input_len, args.shared_prefix)
    assert system.cache is not None
    engine = ctx.make_engine(system, args.max_num_batched_tokens, args.max_num_seqs,
                             getattr(args, "admission", "optimistic"))
    params = SamplingParams.greedy_params(max_tokens=args.output_len, ignore_eos=True)
    scheduler, cache = engine.scheduler, engine.cache

    def once() -> dict[str, Any]:
        scheduler.peak_running = 0  # the engine is reused across repeats: count this run only
        preemptions_before, steps_before = scheduler.num_preemptions, engine.steps
        counters = {"peak_kv": 0, "generated": 0}
        engine.clear_prefix_cache()  # every repeat starts cold: nothing cached from the last one
        prefix_before = engine.prefix_statistics().get("prefix_hit_tokens", 0)

        def count(outputs: list[Any]) -> None:
            counters["generated"] += sum(len(o.new_token_ids) for o in outputs)
            counters["peak_kv"] = max(counters["peak_kv"], cache.memory_usage()["fast"])

        start, cpu_start = time.perf_counter(), time.process_time()
        drain(engine, prompts, params, count)
        generated, peak_kv = counters["generated"], counters["peak_kv"]
        seconds = time.perf_counter() - start
        # CPU seconds of this process: with --threads 1 on a shared, oversubscribed machine
        # it tracks the work done better than wall time (which includes waiting for a core).
        cpu_seconds = time.process_time() - cpu_start
        if generated != args.num_requests * args.output_len:
            raise KVForgeError(f"generated {generated} tokens, expected {args.num_requests * args.output_len}")
        return {"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_concurrent_sequences": scheduler.peak_running,
                "prefix_hit_tokens": engine.prefix_statistics().get("prefix_hit_tokens", 0) - prefix_before,
                "preemptions": scheduler.num_preemptions - preemptions_before,
                "engine_steps": engine.steps - steps_before, "kv_bytes_peak": peak_kv}

    run = repeat_runs(system.name, once, args.warmup, args.repeats)
    run["kv_bytes_capacity"] = cache.memory_capacity()["fast"]
    run["kv_budget_fraction_used"] = run["kv_bytes_peak"] / run["kv_bytes_capacity"]
    # Whole sequences (prompt + output) the budget holds by the cache's own accounting.
    run["admissible_sequences"] = admissible_sequences(cache, args.shared_prefix + args.input_len + args.output_len)
    return run


def admissible_sequences(cache: CacheMethod, num_tokens: int) -> int:
    """The most sequences of `num_tokens` tokens the cache holds at once (`fits_together`,
    every store of a split budget checked; at most what the bytes alone allow)."""
    lo, hi = 0, cache.memory_capacity()["fast"] // cache.sequence_bytes(num_tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cache.fits_together([num_tokens] * mid) else (lo, mid - 1)
    return lo


def _hf(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    prompts = ctx.prompts(args.num_requests, args.input_len, args.shared_prefix)
    batch = args.hf_batch or min(args.num_requests, 16)
    model = ctx.hf_model()
    run = repeat_runs(system.name, lambda: {"seconds": hf_peer.generate(model, prompts, args.output_len, batch)},
                      args.warmup, args.repeats)
    run.update(peak_concurrent_sequences=min(batch, args.num_requests), preemptions=0, hf_batch=batch)
    return run


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("num_requests", "input_len", "output_len", "max_num_batched_tokens", "max_num_seqs"):
        require(getattr(args, name) >= 1, name, getattr(args, name), "must be >= 1")
    require(args.hf_batch is None or args.hf_batch >= 1, "hf_batch", args.hf_batch, "must be >= 1")
    require(args.shared_prefix >= 0, "shared_prefix", args.shared_prefix, "must be >= 0")
    ctx = prepare(args, tokens_per_sequence=args.shared_prefix + args.input_len + args.output_len)
    systems = run_systems(ctx, {"kvforge": _kvforge, "hf": _hf})
    total = args.num_requests * (args.shared_prefix + args.input_len + args.output_len)
    for system in systems:
        system[HEADLINE] = rate(total, system["seconds"])
        system["generated_tokens_per_s"] = rate(args.num_requests * args.output_len, system["seconds"])
    for key, ratio_key in (("peak_concurrent_sequences", "peak_sequences_ratio"),
                           ("admissible_sequences", "admissible_sequences_ratio")):
        for system in systems:  # the system under test relative to each system (1.0 for itself)
            ours, theirs = systems[0].get(key), system.get(key)
            system[ratio_key] = ours / theirs if ours is not None and theirs else None
    settings = {
        "num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
        "shared_prefix": args.shared_prefix,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "admission": getattr(args, "admission", "optimistic"),
        "hf_batch": args.hf_batch or min(args.num_requests, 16), "repeats": args.repeats,
        "warmup": args.warmup, "seed": args.seed, "kv_budget": ctx.kv_budget,
        "kvforge_timing": "all requests added at once, engine stepped to completion (detokenising included)",
        "hf_timing": "model.generate on static batches of hf_batch, min_new_tokens = max_new_tokens",
    }
    columns = [Column(HEADLINE, "total tok/s"), Column("generated_tokens_per_s", "gen tok/s"),
               Column("seconds", "seconds", "{:.2f}"), Column("cpu_seconds", "cpu s", "{:.1f}"),
               Column("peak_concurrent_sequences", "peak seqs", "{}"),
               Column("preemptions", "preempt", "{}"), Column("kv_budget_fraction_used", "KV used", "{:.1%}"),
               Column("prefix_hit_tokens", "prefix hits", "{}"),
               Column("admissible_sequences", "admissible", "{}"),
               Column("peak_sequences_ratio", "peak ratio", "{:.2f}x"),
               Column("admissible_sequences_ratio", "adm. ratio", "{:.2f}x")]
    panel = Panel("generated_tokens_per_s", "generated tokens/s")
    return finish(ctx, "throughput", settings, HEADLINE, systems, columns, panel)
