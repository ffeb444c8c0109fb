"""`kvforge bench decode`: generated tokens per second with the prefill EXCLUDED.

kvforge: `batch` requests of `context` random token ids, max_tokens=gen, greedy,
ignore_eos. The engine is stepped until every request has its first token (the prefill
phase, untimed; max_num_batched_tokens is large so it takes one or a few steps), then the
remaining steps are timed until all requests finish: normally batch * (gen - 1) tokens
in gen - 1 lock-step decode steps (the tokens actually produced are counted).

transformers: the [batch, context] prompt is prefilled into a DynamicCache (untimed), then
gen - 1 forward calls with greedy argmax fed back are timed. This is `generate`'s loop
without its per-step Python overhead, so it favours transformers. `--compare hf-static`
(hf_static_peer.py): the same loop on transformers' static cache with the forward compiled.

llama.cpp (`--compare llama.cpp`, llamacpp_peer.py): the prompts are prefilled as separate
sequences (untimed), then gen - 1 lock-step llama_decode calls of one token per sequence,
greedy argmax fed back, are timed. Its weight bytes per step are its GGUF file's.

Also reported: ms per step and achieved GB/s = (weight bytes + KV bytes read per step) x
steps / time (flops.py), compared with the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import KVForgeError, require
from kvforge.tools.bench import hf_peer, hf_static_peer, llamacpp_peer
from kvforge.tools.bench.common import BenchContext, log, prepare
from kvforge.tools.bench.flops import KVReadModel, decode_bytes, weight_bytes_per_step
from kvforge.tools.bench.measure import rate, repeat_runs, run_systems, timed_rounds
from kvforge.tools.bench.plot import Panel
from kvforge.tools.bench.report import Column, finish
from kvforge.tools.bench.systems import System
from kvforge.tools.bench.throughput import step_split, timer_totals

HEADLINE = "generated_tokens_per_s"
PREFILL_TOKENS_PER_STEP = (2048, 32768)  # bounds of max_num_batched_tokens for the untimed prefill
PROGRESS_MIN_TOKENS = 16384  # smaller prefills take seconds: no progress bar


def _element_size(ctx: BenchContext) -> int:
    return torch.tensor([], dtype=ctx.dtype).element_size()


def _kvforge(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    prompts = ctx.prompts(args.batch, args.context)
    low, high = PREFILL_TOKENS_PER_STEP
    assert system.cache is not None
    params = SamplingParams.greedy_params(max_tokens=args.gen, ignore_eos=True)

    def engine_for(step_timing: bool) -> LLMEngine:
        return ctx.make_engine(system, max_num_batched_tokens=min(high, max(low, args.batch * args.context)),
                               max_num_seqs=max(256, args.batch), step_timing=step_timing,
                               graph_shape=(args.batch, args.context + args.gen))

    engine = engine_for(step_timing=False)
    run = repeat_runs(system.name, functools.partial(_decode_once, engine, prompts, params, system.name),
                      args.warmup, args.repeats)
    run["kv_bytes_per_token"] = engine.cache.memory.kv_bytes_per_token()
    run["bytes_per_step_model"] = KVReadModel.of_cache(engine.cache)
    del engine  # its pages are freed before the next engine takes its own
    # Where a decode step's time goes: one more run, on an engine whose step timer wraps every
    # linear and cache call (that wrapping costs a little, so the headline comes from the runs
    # above, which have no timer; a recording timer also turns the fused decoder-layer op off,
    # kernels/cpu_decode_layer.py, so this run shows the per-op path's parts).
    timed = engine_for(step_timing=True)
    timer = timed.step_timer
    assert timer is not None
    before = timer_totals(timer)
    _decode_once(timed, prompts, params, system.name)
    split = step_split(before, timer_totals(timer))
    run.update({key: value for key, value in split.items() if key.startswith("decode_")})
    return run


def _decode_once(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, name: str) -> dict[str, Any]:
    """One run: every request's prefill (untimed), then the timed decode steps to the end.
    The step timer, if the engine has one, sees the decode steps and the prefill steps apart."""

    def step_outputs() -> list[Any]:
        outputs = engine.step()
        for output in outputs:
            if output.error:
                raise KVForgeError(f"request failed: {output.error}")
        return outputs

    engine.clear_prefix_cache()  # with --prefix-caching, the last repeat must not serve this one
    for prompt in prompts:
        engine.add_request(prompt, params)
    started: set[str] = set()
    prefill_start = time.perf_counter()
    total = engine.num_uncomputed_prompt_tokens()
    # The untimed prefill can take many minutes (4 x 32K tokens on CPU): show its progress.
    with tqdm(total=total, desc=f"{name} prefill (untimed)", unit="tok", file=sys.stderr,
              disable=total < PROGRESS_MIN_TOKENS) as bar:
        while len(started) < len(prompts):  # prefill phase, untimed
            started.update(o.request_id for o in step_outputs() if o.new_token_ids)
            bar.update(total - engine.num_uncomputed_prompt_tokens() - bar.n)
    prefill_seconds = time.perf_counter() - prefill_start
    # What the cache holds with every prompt in it, and counters of the timed phase only
    # (methods with counters, e.g. shadowkv, can reset them).
    held = engine.cache.memory_usage()
    reset = getattr(engine.cache, "reset_statistics", None)
    if reset is not None:
        reset()
    steps_before, tokens = engine.steps, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in step_outputs())
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "steps": engine.steps - steps_before,
            "prefill_seconds": prefill_seconds, "cache_bytes_after_prefill": held,
            "cache_statistics": engine.cache.statistics()}


def _hf(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    prompts = ctx.prompts(args.batch, args.context)
    model = ctx.hf_model()
    run = repeat_runs(system.name, lambda: hf_peer.decode(model, prompts, args.gen), args.warmup, args.repeats)
    return {**run, **_dense_kv(ctx)}


def _hf_static(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    prompts = ctx.prompts(args.batch, args.context)
    peer = hf_static_peer.StaticPeer(ctx.hf_model(), max_len=args.context + args.gen)
    compile_seconds = peer.compile_decode(prompts, args.gen)
    log(f"{system.name}: first run, which compiles, {compile_seconds:.1f} s (untimed)")
    run = repeat_runs(system.name, lambda: peer.decode(prompts, args.gen), args.warmup, args.repeats)
    return {**run, "compile_seconds": compile_seconds, **_dense_kv(ctx)}


def _dense_kv(ctx: BenchContext) -> dict[str, Any]:
    """A transformers cache's K/V per token (what attention reads of it: a static cache's
    unused tail is masked, and counting it would credit the peer with bytes of no use)."""
    kv = KVReadModel.of_dense(ctx.config, _element_size(ctx))
    return {"kv_bytes_per_token": sum(kv.bytes_per_token), "bytes_per_step_model": kv}


def _llama_cpp(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    prompts = ctx.prompts(args.batch, args.context)
    with llamacpp_peer.open_session(ctx, system, sequences=args.batch, tokens_per_sequence=args.context + args.gen,
                                    prompt_tokens=args.batch * args.context) as session:
        run = repeat_runs(system.name, lambda: llamacpp_peer.decode(session, prompts, args.gen), args.warmup,
                          args.repeats)
        run["llama_cpp"] = llamacpp_peer.describe(session, system.weights)
        run["weight_bytes_per_step"] = llamacpp_peer.weight_bytes_per_step(session.path)
    kv = KVReadModel.of_dense(ctx.config, llamacpp_peer.KV_ELEMENT_BYTES)
    run["kv_bytes_per_token"] = sum(kv.bytes_per_token)
    run["bytes_per_step_model"] = kv
    return run


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("batch", "context"):
        require(getattr(args, name) >= 1, name, getattr(args, name), "must be >= 1")
    require(args.gen >= 2, "gen", args.gen, "must be >= 2 (the first token comes from the prefill)")
    ctx = prepare(args, tokens_per_sequence=args.context + args.gen, llama_cpp=True, hf_static=True)
    systems = run_systems(ctx, {"kvforge": _kvforge, "hf": _hf, hf_static_peer.NAME: _hf_static,
                                "llama.cpp": _llama_cpp})
    weights = weight_bytes_per_step(ctx.config, _element_size(ctx))
    for system in systems:
        kv: KVReadModel = system.pop("bytes_per_step_model")
        seconds, steps = system["seconds"], max(system["steps"], 1)
        own = system.get("weight_bytes_per_step", weights)  # set by a peer with its own weight types (llama.cpp)
        total = decode_bytes(own, kv, args.batch, args.context, args.gen - 1)
        system[HEADLINE] = rate(system["tokens"], seconds)
        system["ms_per_step"] = seconds / steps * 1e3
        system["weight_bytes_per_step"] = own
        system["kv_bytes_per_step_mean"] = total / (args.gen - 1) - own
        system["achieved_gbps"] = rate(total, seconds) / 1e9
        system["fraction_of_read_bandwidth"] = system["achieved_gbps"] / ctx.peak.read_gbps
    settings = {
        "batch": args.batch, "context": args.context, "gen": args.gen, "timed_steps": args.gen - 1,
        "repeats": args.repeats, "rounds": timed_rounds(args), "warmup": args.warmup, "seed": args.seed,
        "kv_budget": ctx.kv_budget,
        "prefill": "excluded (untimed); timing starts once every request has its first token",
        "hf_timing": "G-1 forward calls with a DynamicCache and argmax feedback: generate's loop "
                     "without its Python overhead, which favours transformers",
        "hf_static_timing": hf_static_peer.TIMING["decode"],
        "llama_cpp_timing": llamacpp_peer.TIMING["decode"],
        "step_split": "kvforge systems: one extra run on an engine with step timing (kvforge.step_timing): "
                      "'timed ms' is its ms per decode step and linear/attn/sampling/rest its parts (rest = "
                      "embedding, norms, RoPE, scheduling, batch building, Python); the timers add their own "
                      "overhead, so 'timed ms' exceeds ms/step by about that; the timed run takes the per-op "
                      "path (the fused decoder-layer op is off while a step timer records), so 'rest' there "
                      "includes Python that the headline runs do not pay",
    }
    columns = [Column(HEADLINE, "gen tok/s"), Column("ms_per_step", "ms/step"), Column("achieved_gbps", "GB/s"),
               Column("fraction_of_read_bandwidth", "of read BW", "{:.2f}"), Column("tokens", "tokens", "{}"),
               Column("prefill_seconds", "prefill s"), Column("decode_ms_per_step", "timed ms"),
               Column("decode_linear_ms", "linear"), Column("decode_attention_ms", "attn"),
               Column("decode_sampling_ms", "sampling"), Column("decode_rest_ms", "rest"),
               Column("compile_seconds", "compile s")]
    panel = Panel("achieved_gbps", "achieved GB/s (weights + KV)", ctx.peak.read_gbps, "measured read")
    # Reading weights and KV once per step cannot go faster than the machine reads memory.
    bounds = [{"what": f"{s['name']} achieved GB/s / measured read bandwidth", "ratio": s["fraction_of_read_bandwidth"],
               "bound": 1.0, "why": "the read-bandwidth roofline measured in this run"} for s in systems]
    return finish(ctx, "decode", settings, HEADLINE, systems, columns, panel, bounds)
