"""`kvforge bench throughput`: many requests submitted at once, served to completion.

kvforge: all `num_requests` prompts (random ids, `input_len` tokens each, after a shared
system prompt of `--shared-prefix` tokens) are added to the
engine at once (max_tokens=output_len, greedy, ignore_eos), and the engine is stepped until
every request finishes, as `LLM.generate` does (detokenising included). The continuous-
batching scheduler mixes prefill chunks and decode tokens under max_num_batched_tokens;
--kv-budget caps the cache, so a small budget shows up as lower concurrency and preemptions;
several comma-separated budgets run every kvforge system under each (bench/budgets.py).

transformers: `model.generate` on static batches of --hf-batch prompts (default
min(N, 16)), max_new_tokens = min_new_tokens = output_len, greedy. All prompts have the
same length, so nothing is padded.

Headline: total_tokens_per_s = N * (input_len + output_len) / wall time (its ratio between
two systems equals the generated-tokens/s ratio: same work). Also generated tokens/s, peak
concurrent sequences, preemptions, the peak KV bytes in use, the whole sequences the budget
admits by the cache's accounting, and both counts relative to the system under test.
--admission reserve admits a request only when every running request's prompt + max_tokens
fits the budget (applied to every kvforge system alike; no preemption).

Step split (kvforge systems, kvforge.step_timing): the headline runs have no step timer,
since a recording timer turns the fused decoder-layer op off and would slow the systems
that use it. Once per system and budget (the first round; `--no-step-split` skips it) one
more run of the same workload on a timed engine gives, for that run, the steps of each kind ("decode": every
sequence adds one generated token; "prefill": the step computes prompt tokens, possibly
beside decode tokens), the mean ms per step and its parts: linear layers, attention (the
cache's `write` and `attend` calls, so storing K/V, quantising included), sampling, and
rest = step - those parts (embedding, norms, RoPE, scheduling, batch building,
detokenising, Python). On CUDA the timer synchronises around every timed call, which
lowers the headline there; on CPU it costs little.

Attention rates of the decode steps (an approximation, stated in the JSON's settings):
  bytes = for each decode token, `cache.memory.sequence_bytes(n)` of its sequence, n = the keys
          it attends (every token of the sequence after the step): what the cache method's
          own accounting says such a sequence holds (page-rounded, sliding windows bound it,
          KIVI's full-precision residual slot included). It is the KV read per layer when
          each model layer reads its cache layer once and attention is dense; it overstates
          what sparse attention reads (shadowkv) and understates it where several model
          layers read one cache layer (AcrossKV);
  FLOPs = for each decode token, 4 * num_heads * head_dim per visible key (QK^T and PV,
          2 FLOPs per multiply-add), summed over model layers, a sliding-window layer
          seeing at most its window (flops.attention_flops);
  achieved GB/s and GFLOP/s = these over the decode steps' attention seconds, beside the
  read bandwidth and matmul peak measured in the same run. A decode step that recomputes
  several generated tokens of a preempted sequence counts only its last token.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from kvforge.cache.base import CacheMethod
from kvforge.config import ModelConfig
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import KVForgeError, require
from kvforge.step_timing import PARTS, STEP_KINDS, StepTimer
from kvforge.tools.bench import hf_peer
from kvforge.tools.bench.common import BenchContext, drain, log, prepare
from kvforge.tools.bench.flops import attention_flops
from kvforge.tools.bench.measure import rate, repeat_runs, run_systems, timed_rounds
from kvforge.tools.bench.plot import Panel
from kvforge.tools.bench.report import Column, finish
from kvforge.tools.bench.systems import System

HEADLINE = "total_tokens_per_s"


def _kvforge(ctx: BenchContext, system: System) -> dict[str, Any]:
    """The headline runs on an engine without a step timer, so every fast path a user gets
    runs (a recording timer turns the fused decoder-layer op off: kernels/cpu_decode_layer.py);
    then, once per system and budget (the first round), one more run of the same workload on
    a timed engine gives the step split and the attention's rates (`_split_run`)."""
    args = ctx.args
    prompts = ctx.prompts(args.num_requests, args.input_len, args.shared_prefix)
    assert system.cache is not None
    params = SamplingParams.greedy_params(max_tokens=args.output_len, ignore_eos=True)
    run = _headline_runs(ctx, system, prompts, params)  # its engine and pages are gone on return
    key = (system.name, ctx.kv_budget)
    if getattr(args, "step_split", True) and key not in ctx.split_done:
        ctx.split_done.add(key)
        run.update(_split_run(ctx, system, prompts, params))
    return run


def _headline_runs(ctx: BenchContext, system: System, prompts: list[list[int]],
                   params: SamplingParams) -> dict[str, Any]:
    """Warmups and timed repeats on one engine without a step timer."""
    args = ctx.args
    engine = _engine(ctx, system, step_timing=False)
    scheduler, cache = engine.scheduler, engine.cache

    def once() -> dict[str, Any]:
        scheduler.peak_running = 0  # the engine is reused across repeats: count this run only
        preemptions_before, steps_before = scheduler.num_preemptions, engine.steps
        engine.clear_prefix_cache()  # every repeat starts cold: nothing cached from the last one
        prefix_before = engine.prefix_statistics().get("prefix_hit_tokens", 0)
        start, cpu_start = time.perf_counter(), time.process_time()
        generated, peak_kv, _ = _drain_counting(engine, prompts, params)
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
    run["kv_bytes_per_token"] = cache.memory.kv_bytes_per_token()
    run["kv_bytes_capacity"] = cache.memory.capacity["fast"]
    run["kv_budget_fraction_used"] = run["kv_bytes_peak"] / run["kv_bytes_capacity"]
    # Whole sequences (prompt + output) the budget holds by the cache's own accounting.
    run["admissible_sequences"] = admissible_sequences(cache, args.shared_prefix + args.input_len + args.output_len)
    return run


def _engine(ctx: BenchContext, system: System, step_timing: bool) -> Any:
    args = ctx.args
    # CUDA graphs for decode steps of up to every running sequence at the run's longest
    # length (the engine's default stops at 8,192 tokens, which long-context runs pass)
    longest = args.shared_prefix + args.input_len + args.output_len
    return ctx.make_engine(system, args.max_num_batched_tokens, args.max_num_seqs,
                           getattr(args, "admission", "optimistic"), step_timing=step_timing,
                           graph_shape=(args.max_num_seqs, longest))


def _drain_counting(engine: Any, prompts: list[list[int]], params: SamplingParams) -> tuple[int, int, Counter[int]]:
    """Run every prompt to the end: (tokens generated, peak KV bytes, decode_keys), where
    decode_keys[n] counts the decode tokens that attended n keys."""
    counters = {"peak_kv": 0, "generated": 0}
    decode_keys: Counter[int] = Counter()

    def count(outputs: list[Any]) -> None:
        counters["generated"] += sum(len(o.new_token_ids) for o in outputs)
        counters["peak_kv"] = max(counters["peak_kv"], engine.cache.memory_usage()["fast"])
        if engine.last_step_kind == "decode":
            # Every sequence of a decode step sampled a token, so each has an output here; it
            # attended all its tokens but the one just sampled (prompt + outputs - 1).
            decode_keys.update(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outputs)

    drain(engine, prompts, params, count)
    return counters["generated"], counters["peak_kv"], decode_keys


def _split_run(ctx: BenchContext, system: System, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """One run of the workload on an engine whose step timer wraps every linear and cache
    call: the step split (`step_split`) and the decode attention's rates. Its time is
    `split_run_seconds`, never the headline (the timer costs a little, and it runs the
    per-op path where the headline may run the fused decoder layer)."""
    engine = _engine(ctx, system, step_timing=True)
    timer = engine.step_timer
    assert timer is not None  # step_timing=True
    before = timer_totals(timer)
    start = time.perf_counter()
    _, _, decode_keys = _drain_counting(engine, prompts, params)
    seconds = time.perf_counter() - start
    log(f"{system.name}: step split run {seconds:.3f} s (timed per op; not the headline)")
    after = timer_totals(timer)
    num_bytes, flops = decode_attention_work(engine.cache, engine.model.config, decode_keys)
    decode_steps = round(after["decode"]["steps"] - before["decode"]["steps"])
    attention_seconds = after["decode"]["attention"] - before["decode"]["attention"]
    return {"split_run_seconds": seconds, **step_split(before, after),
            **attention_rates(num_bytes, flops, attention_seconds, decode_steps)}


def timer_totals(timer: StepTimer) -> dict[str, dict[str, float]]:
    """A copy of the timer's cumulative figures per step kind: seconds of each part and of
    the whole "step", and the count of steps under "steps"."""
    return {kind: {**timer.seconds[kind], "steps": float(timer.steps[kind])} for kind in STEP_KINDS}


def step_split(before: Mapping[str, Mapping[str, float]],
               after: Mapping[str, Mapping[str, float]]) -> dict[str, float | int | None]:
    """The steps timed between two `timer_totals`, per kind K ("decode", "prefill"):
    K_steps, K_seconds (their whole time), K_ms_per_step and its parts K_linear_ms,
    K_attention_ms, K_sampling_ms, K_rest_ms (ms per step; None with no step of kind K).

    Invariant: the four parts sum to K_ms_per_step. rest = step - the timed parts; the
    timer measures its parts inside the step and never one inside another, so rest >= 0
    but for float rounding, which the clamp at 0 absorbs."""
    out: dict[str, float | int | None] = {}
    for kind in STEP_KINDS:
        steps = round(after[kind]["steps"] - before[kind]["steps"])
        step_seconds = after[kind]["step"] - before[kind]["step"]
        parts = {part: after[kind][part] - before[kind][part] for part in PARTS}
        parts["rest"] = max(0.0, step_seconds - sum(parts.values()))
        out[f"{kind}_steps"] = steps
        out[f"{kind}_seconds"] = step_seconds
        out[f"{kind}_ms_per_step"] = sum(parts.values()) / steps * 1e3 if steps else None
        for part, seconds in parts.items():
            out[f"{kind}_{part}_ms"] = seconds / steps * 1e3 if steps else None
    return out


def decode_attention_work(cache: CacheMethod, config: ModelConfig, decode_keys: Mapping[int, int]) -> tuple[int, int]:
    """(bytes, FLOPs) of the attention of decode tokens, `decode_keys[n]` of which attended
    n keys (their sequence holds n tokens after the step). Per token: bytes =
    `cache.memory.sequence_bytes(n)`, FLOPs = `attention_flops(config, 1, n - 1)` (module docstring)."""
    num_bytes = sum(count * cache.memory.sequence_bytes(n) for n, count in decode_keys.items())
    flops = sum(count * attention_flops(config, 1, cached=n - 1) for n, count in decode_keys.items())
    return num_bytes, flops


def attention_rates(num_bytes: int, flops: int, seconds: float, steps: int) -> dict[str, float | None]:
    """Per decode step bytes and FLOPs, and achieved GB/s and GFLOP/s over `seconds` of
    attention (None without a timed decode step)."""
    timed = steps > 0 and seconds > 0
    return {"attention_bytes_per_decode_step": num_bytes / steps if steps > 0 else None,
            "attention_flops_per_decode_step": flops / steps if steps > 0 else None,
            "attention_gbps": num_bytes / seconds / 1e9 if timed else None,
            "attention_gflops": flops / seconds / 1e9 if timed else None}


def admissible_sequences(cache: CacheMethod, num_tokens: int) -> int:
    """The most sequences of `num_tokens` tokens the cache holds at once (`fits_together`,
    every store of a split budget checked; at most what the bytes alone allow)."""
    lo, hi = 0, cache.memory.capacity["fast"] // cache.memory.sequence_bytes(num_tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cache.memory.fits_together([num_tokens] * mid) else (lo, mid - 1)
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
    ctx = prepare(args, tokens_per_sequence=args.shared_prefix + args.input_len + args.output_len,
                  several_budgets=True)
    total = args.num_requests * (args.shared_prefix + args.input_len + args.output_len)

    def headline(system: dict[str, Any]) -> None:
        system[HEADLINE] = rate(total, system["seconds"])
        system["generated_tokens_per_s"] = rate(args.num_requests * args.output_len, system["seconds"])
        if system.get("attention_gbps") is not None:  # the attention's rates beside this run's peaks
            system["attention_fraction_of_read_bandwidth"] = system["attention_gbps"] / ctx.peak.read_gbps
            system["attention_fraction_of_matmul_peak"] = system["attention_gflops"] / ctx.peak.matmul_gflops

    if len(ctx.kv_budgets) > 1:
        from kvforge.tools.bench.budgets import run_budgets

        for system in ctx.systems:
            require(system.kind == "kvforge", "compare", system.name,
                    "several --kv-budget values measure kvforge systems only (no budget binds the peer)")
        return run_budgets(ctx, _kvforge, headline, _settings(args, ctx))
    systems = run_systems(ctx, {"kvforge": _kvforge, "hf": _hf})
    for system in systems:
        headline(system)
    for key, ratio_key in (("peak_concurrent_sequences", "peak_sequences_ratio"),
                           ("admissible_sequences", "admissible_sequences_ratio")):
        for system in systems:  # the system under test relative to each system (1.0 for itself)
            ours, theirs = systems[0].get(key), system.get(key)
            system[ratio_key] = ours / theirs if ours is not None and theirs else None
    columns = [Column(HEADLINE, "total tok/s"), Column("generated_tokens_per_s", "gen tok/s"),
               Column("seconds", "seconds", "{:.2f}"), Column("cpu_seconds", "cpu s", "{:.1f}"),
               Column("peak_concurrent_sequences", "peak seqs", "{}"),
               Column("preemptions", "preempt", "{}"), Column("kv_budget_fraction_used", "KV used", "{:.1%}"),
               Column("prefix_hit_tokens", "prefix hits", "{}"),
               Column("admissible_sequences", "admissible", "{}"),
               Column("peak_sequences_ratio", "peak ratio", "{:.2f}x"),
               Column("admissible_sequences_ratio", "adm. ratio", "{:.2f}x"),
               Column("decode_steps", "dec steps", "{}"), Column("decode_ms_per_step", "ms/dec step"),
               Column("decode_linear_ms", "linear ms"), Column("decode_attention_ms", "attn ms"),
               Column("decode_sampling_ms", "sampling ms"), Column("decode_rest_ms", "rest ms")]
    panel = Panel("generated_tokens_per_s", "generated tokens/s")
    return finish(ctx, "throughput", _settings(args, ctx), HEADLINE, systems, columns, panel)


def _settings(args: argparse.Namespace, ctx: BenchContext) -> dict[str, Any]:
    return {
        "num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
        "shared_prefix": args.shared_prefix,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "admission": getattr(args, "admission", "optimistic"),
        "hf_batch": args.hf_batch or min(args.num_requests, 16), "repeats": args.repeats,
        "rounds": timed_rounds(args),
        "warmup": args.warmup, "seed": args.seed,
        "kv_budget": ctx.kv_budget if len(ctx.kv_budgets) == 1 else list(ctx.kv_budgets),
        "kvforge_timing": "all requests added at once, engine stepped to completion (detokenising included)",
        "hf_timing": "model.generate on static batches of hf_batch, min_new_tokens = max_new_tokens",
        "step_split": "kvforge engines time their steps (timed runs only): ms per decode / prefill-containing "
                      "step = linear + attention (cache write + attend) + sampling + rest",
        "attention_work": "approximation: bytes = cache.memory.sequence_bytes(n) per decode token attending n keys "
                          "(what the cache's accounting says the sequence holds); FLOPs = 4 * heads * head_dim "
                          "per visible key and layer (sliding windows respected); rates over attention seconds",
    }

