"""Where a decode step's time goes on a device: torch.profiler over a few lock-step decode
steps of one engine, for each cache spec given. Prints, per spec, the untimed ms per step,
then the top operators by device time and by host (CPU) time, and how many kernels one
step launches. A study tool for GPU sessions (benchmarks/gpu/run_on_device.sh), not a bench:
the headline speeds come from `kvforge bench decode`.

    python benchmarks/gpu/profile_decode.py --model DIR --device cuda --batch 16 --context 2048 \
        --spec full --spec kivi:bits=2 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

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


def profile_spec(args: argparse.Namespace, spec: str) -> dict:
    device = torch.device(args.device)
    llm = LLM(args.model, cache=spec, dtype=args.dtype, kv_budget=args.kv_budget, device=args.device,
              max_num_batched_tokens=max(2048, args.batch * args.context), prefix_caching=False)
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
    with profile(activities=activities) as prof:
        for _ in range(args.profiled):
            engine.step()
        _sync(device)
    events = prof.key_averages()
    device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    # device-side entries (kernels, copies, sets) of the profiled steps
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    rows = {"by_device": events.table(sort_by=device_key, row_limit=args.rows, max_name_column_width=70),
            "by_host": events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70)}
    result = {"spec": spec, "ms_per_step": ms_per_step, "kernels_per_step_estimate": kernels / args.profiled,
              "profiled_steps": args.profiled}
    print(f"\n##### {spec}: {ms_per_step:.2f} ms per decode step (untimed, {args.timed} steps), "
          f"~{kernels / args.profiled:.0f} kernels per step")
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
