"""`kvforge bench prefill`: how fast a prompt becomes its first token.

kvforge: `batch` requests of `prompt_len` random token ids, max_tokens=1, greedy, through
the engine with max_num_batched_tokens = prompt_len * batch, so the whole prefill is one
engine step (checked: `engine_steps` is reported). Timed from the first add_request to the
last finished output: time to first token, including scheduling, sampling and detokenising.

transformers: one forward call `model(ids, logits_to_keep=1)` under inference_mode (what
generate(max_new_tokens=1) computes without its set-up code), plus the argmax.
`--compare hf-static` (hf_static_peer.py): the same call compiled, into a static cache.

llama.cpp (`--compare llama.cpp`, llamacpp_peer.py): the prompts as separate sequences in one
llama_decode call, plus the argmax of each sequence's logits.

Headline: prompt_tokens_per_s = prompt_len * batch / seconds. Also achieved GFLOP/s from
the analytic FLOP count (flops.py) and its fraction of the matmul peak measured in this run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvforge.engine.sampling import SamplingParams
from kvforge.errors import require
from kvforge.tools.bench import hf_peer, hf_static_peer, llamacpp_peer
from kvforge.tools.bench.common import BenchContext, drain, log, prepare
from kvforge.tools.bench.flops import prefill_flops
from kvforge.tools.bench.measure import rate, repeat_runs, run_systems, timed_rounds
from kvforge.tools.bench.plot import Panel
from kvforge.tools.bench.report import Column, finish
from kvforge.tools.bench.systems import System

HEADLINE = "prompt_tokens_per_s"


def _kvforge(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    prompts = ctx.prompts(args.batch, args.prompt_len)
    assert system.cache is not None
    engine = ctx.make_engine(system, max_num_batched_tokens=args.prompt_len * args.batch,
                             max_num_seqs=max(256, args.batch))
    params = SamplingParams.greedy_params(max_tokens=1, ignore_eos=True)

    def once() -> dict[str, Any]:
        engine.clear_prefix_cache()  # with --prefix-caching, the last repeat must not serve this one
        steps_before = engine.steps
        start = time.perf_counter()
        drain(engine, prompts, params)
        return {"seconds": time.perf_counter() - start, "engine_steps": engine.steps - steps_before}

    run = repeat_runs(system.name, once, args.warmup, args.repeats)
    model_config = ctx.model_for(system)[0].config
    run["flops_total"] = prefill_flops(model_config, args.prompt_len, args.batch).total  # SwiftKV does less
    return run


def _hf(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    prompts = ctx.prompts(args.batch, args.prompt_len)
    model = ctx.hf_model()
    run = repeat_runs(system.name, lambda: {"seconds": hf_peer.prefill(model, prompts)}, args.warmup, args.repeats)
    return run


def _hf_static(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    prompts = ctx.prompts(args.batch, args.prompt_len)
    peer = hf_static_peer.StaticPeer(ctx.hf_model(), max_len=args.prompt_len)
    compile_seconds = peer.compile_prefill(prompts)
    log(f"{system.name}: first run, which compiles, {compile_seconds:.1f} s (untimed)")
    run = repeat_runs(system.name, lambda: {"seconds": peer.prefill(prompts)}, args.warmup, args.repeats)
    return {**run, "compile_seconds": compile_seconds}


def _llama_cpp(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    prompts = ctx.prompts(args.batch, args.prompt_len)
    with llamacpp_peer.open_session(ctx, system, sequences=args.batch, tokens_per_sequence=args.prompt_len + 1,
                                    prompt_tokens=args.batch * args.prompt_len) as session:
        session.load_prompts(prompts)  # the same batch every run: filled once, untimed
        run = repeat_runs(system.name, lambda: {"seconds": llamacpp_peer.prefill(session)}, args.warmup, args.repeats)
        run["llama_cpp"] = llamacpp_peer.describe(session, system.weights)
    return run


def run(args: argparse.Namespace) -> dict[str, Any]:
    require(args.prompt_len >= 1, "prompt_len", args.prompt_len, "must be >= 1")
    require(args.batch >= 1, "batch", args.batch, "must be >= 1")
    ctx = prepare(args, tokens_per_sequence=args.prompt_len + 1, llama_cpp=True, hf_static=True)
    flops = prefill_flops(ctx.config, args.prompt_len, args.batch)
    systems = run_systems(ctx, {"kvforge": _kvforge, "hf": _hf, hf_static_peer.NAME: _hf_static,
                                "llama.cpp": _llama_cpp})
    tokens = args.prompt_len * args.batch
    for system in systems:
        seconds = system["seconds"]
        system[HEADLINE] = rate(tokens, seconds)
        system["ms_to_first_token"] = seconds * 1e3
        system["achieved_gflops"] = rate(system.get("flops_total", flops.total), seconds) / 1e9
        system["fraction_of_matmul_peak"] = system["achieved_gflops"] / ctx.peak.matmul_gflops
    settings = {
        "prompt_len": args.prompt_len, "batch": args.batch, "repeats": args.repeats, "rounds": timed_rounds(args),
        "warmup": args.warmup,
        "seed": args.seed, "kv_budget": ctx.kv_budget, "max_num_batched_tokens": tokens,
        "flops": {"linear": flops.linear, "attention": flops.attention, "lm_head": flops.lm_head,
                  "total": flops.total},
        "kvforge_timing": "engine: add_request -> finished output (one step, max_tokens=1)",
        "hf_timing": "one forward call model(ids, logits_to_keep=1) under inference_mode + argmax",
        "hf_static_timing": hf_static_peer.TIMING["prefill"],
        "llama_cpp_timing": llamacpp_peer.TIMING["prefill"],
    }
    columns = [Column(HEADLINE, "prompt tok/s"), Column("ms_to_first_token", "ms TTFT"),
               Column("achieved_gflops", "GFLOP/s"), Column("fraction_of_matmul_peak", "of peak", "{:.2f}"),
               Column("engine_steps", "steps", "{}"), Column("compile_seconds", "compile s")]
    panel = Panel("achieved_gflops", "achieved GFLOP/s", ctx.peak.matmul_gflops, "matmul peak")
    return finish(ctx, "prefill", settings, HEADLINE, systems, columns, panel, flop_bounds(systems))


def flop_bounds(systems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system under test's speed-up over another kvforge system that does more FLOPs
    per prompt (SwiftKV against its base model) cannot honestly exceed the FLOP ratio: the
    same engine runs the same kind of matmuls, only fewer of them."""
    ours = systems[0]
    out = []
    for other in systems[1:]:
        if "flops_total" in ours and "flops_total" in other and ours["flops_total"] != other["flops_total"]:
            out.append({"what": f"{HEADLINE} {ours['name']} / {other['name']}",
                        "ratio": ours[HEADLINE] / other[HEADLINE] if other[HEADLINE] else None,
                        "bound": other["flops_total"] / ours["flops_total"],
                        "why": "FLOPs of the prefill: the other system's over the system under test's"})
    return out
