"""Where a decode step's time goes on a device: torch.profiler over a few lock-step decode
steps of one engine, for each cache spec given. Prints, per spec, the untimed ms per step,
then the top operators by device time and by host (CPU) time, how many kernels one step
launches, and how many of them one decoder layer launches (kernels whose launching host
event lies inside a layer's forward, marked by a profiler range per layer; on the CPU, where
nothing launches kernels, the leaf ATen ops per layer instead, and none when the fused CPU
decode layer runs the layers in one call). A study tool for GPU sessions
(benchmarks/gpu/run_on_device.sh), not a bench: the headline speeds come from
`kvforge bench decode`. Steps run eagerly (`enforce_eager`), so that kernels can be counted
per layer; the ms per step is the eager step's.

    python benchmarks/gpu/profile_decode.py --model DIR --device cuda --batch 16 --context 2048 \
        --spec full --spec kivi:bits=2 [--json OUT]
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from kvforge.engine.llm import LLM
from kvforge.engine.sampling import SamplingParams


def _prefill(llm: LLM, batch: int, context: int, gen: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, llm.model.config.vocab_size, (batch, context), generator=generator).tolist()
    params = SamplingParams.greedy_params(max_tokens=gen, ignore_eos=True)
    engine = llm.engine
    for prompt in ids:
        engine.add_request(prompt, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


LAYER_RANGE = "kvforge::decoder_layer"


@contextmanager
def layer_ranges(layers: nn.ModuleList) -> Iterator[None]:
    """A profiler range named LAYER_RANGE around every decoder layer's forward."""
    open_ranges: list[record_function] = []

    def enter(module: nn.Module, inputs: tuple) -> None:
        open_ranges.append(record_function(LAYER_RANGE))
        open_ranges[-1].__enter__()

    def leave(module: nn.Module, inputs: tuple, output: object) -> None:
        open_ranges.pop().__exit__(None, None, None)

    handles = [h for layer in layers for h in (layer.register_forward_pre_hook(enter),
                                               layer.register_forward_hook(leave))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def per_layer_counts(events: list) -> dict:
    """Layer forwards seen, device kernels launched inside them, and leaf ATen ops inside
    them, from the profiler's host events (a kernel is counted on the host event that
    launched it: an operator, or the runtime/driver call of a Triton launch)."""
    ranges: dict[int, list[tuple[float, float]]] = {}
    for event in events:
        if event.name == LAYER_RANGE:
            ranges.setdefault(event.thread, []).append((event.time_range.start, event.time_range.end))
    for spans in ranges.values():
        spans.sort()
    kernels = aten_ops = 0
    for event in events:
        spans = ranges.get(event.thread)
        if event.name == LAYER_RANGE or not spans:
            continue
        index = bisect.bisect_right(spans, (event.time_range.start, float("inf"))) - 1
        if index < 0 or event.time_range.start > spans[index][1]:
            continue
        kernels += len(event.kernels)
        aten_ops += event.name.startswith("aten::") and not event.cpu_children
    return {"layer_calls": sum(len(spans) for spans in ranges.values()), "kernels": kernels, "aten_ops": aten_ops}


def profile_spec(args: argparse.Namespace, spec: str) -> dict:
    device = torch.device(args.device)
    # Eager steps: a replayed CUDA graph launches its kernels from no layer's forward, so
    # they could not be counted per layer (`kvforge bench decode` times the graphs).
    llm = LLM(args.model, cache=spec, dtype=args.dtype, kv_budget=args.kv_budget, device=args.device,
              max_num_batched_tokens=max(2048, args.batch * args.context), prefix_caching=False, enforce_eager=True)
    engine = llm.engine
    _prefill(llm, args.batch, args.context, args.warmup + args.timed + args.profiled + 2, args.seed)
    for _ in range(args.warmup):
        engine.step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.timed):
        engine.step()
    _sync(device)
    ms_per_step = (time.perf_counter() - start) / args.timed * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with layer_ranges(llm.model.model.layers), profile(activities=activities) as prof:
        for _ in range(args.profiled):
            engine.step()
        _sync(device)
    layers = per_layer_counts(prof.events())
    events = prof.key_averages()
    device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    # device-side entries (kernels, copies, sets) of the profiled steps
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    rows = {"by_device": events.table(sort_by=device_key, row_limit=args.rows, max_name_column_width=70),
            "by_host": events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70)}
    calls = layers["layer_calls"]
    per_layer = {"kernels": layers["kernels"] / calls, "aten_ops": layers["aten_ops"] / calls} if calls else None
    result = {"spec": spec, "ms_per_step": ms_per_step, "kernels_per_step_estimate": kernels / args.profiled,
              "profiled_steps": args.profiled, "decoder_layers": len(llm.model.model.layers),
              "layer_calls_profiled": calls, "per_decoder_layer": per_layer}
    print(f"\n##### {spec}: {ms_per_step:.2f} ms per decode step (untimed, {args.timed} steps), "
          f"~{kernels / args.profiled:.0f} kernels per step")
    if per_layer is None:
        print("per decoder layer: no layer forward ran (the fused CPU decode layer runs them in one call)")
    else:
        kernels_text = (f"{per_layer['kernels']:.1f} device kernels (target <= 20 for `full`), "
                        if device.type == "cuda" else "no device kernels on the CPU, ")
        print(f"per decoder layer ({calls} layer calls): {kernels_text}{per_layer['aten_ops']:.1f} leaf ATen ops")
    print(f"--- top by self device time ({args.profiled} steps)\n{rows['by_device']}")
    print(f"--- top by self host time ({args.profiled} steps)\n{rows['by_host']}")
    del llm, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-budget", default="4GiB")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--spec", action="append", required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timed", type=int, default=10)
    parser.add_argument("--profiled", type=int, default=3)
    parser.add_argument("--rows", type=int, default=22)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [profile_spec(args, spec) for spec in args.spec]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
