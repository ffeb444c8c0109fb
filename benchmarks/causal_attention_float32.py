"""A/B of the float32 causal prefill kernel (kernels/cpu_causal_attention) against ATen.

Three systems per shape, alternated round by round in one process, medians reported:
- `kernel`: `causal_attention(q, k, v, scale)` (grouped K/V read in place);
- `engine before`: `cache.attention.chunk_attention` with the kernels disabled, the path a
  float32 prefill took before (K/V expanded per query head, then ATen's flash attention:
  `is_causal` for a whole prompt, the past/own split merged by log-sum-exp for a chunk);
- `sdpa`: `F.scaled_dot_product_attention(..., is_causal=True)` on K/V expanded beforehand
  (whole prompts only: for a chunk at the end of its keys is_causal aligns the wrong corner).

    PYTHONPATH=src python benchmarks/causal_attention_float32.py [--rounds 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvforge.cache.attention import chunk_attention
from kvforge.kernels.cpu_causal_attention import causal_attention

HEADS, KV_HEADS, DIM = 9, 3, 64  # smollm2-135m
SHAPES = ((1000, 1000), (2048, 2048), (120, 2136))  # (queries, keys): queries are the last keys


def engine_before(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    os.environ["KVFORGE_DISABLE_CPU_KERNELS"] = "1"
    try:
        return chunk_attention(q, k, v, k.shape[1] - q.shape[0], 0, scale, None)
    finally:
        del os.environ["KVFORGE_DISABLE_CPU_KERNELS"]


def systems(n: int, m: int) -> tuple[dict[str, Callable[[], object]], float]:
    """The calls to time for one shape, and its causal FLOPs (two products of 2 D each per
    visible query-key pair)."""
    g = torch.Generator().manual_seed(n + m)
    q = torch.randn(n, HEADS, DIM, generator=g)
    k, v = torch.randn(KV_HEADS, m, DIM, generator=g), torch.randn(KV_HEADS, m, DIM, generator=g)
    scale = DIM ** -0.5
    calls: dict[str, Callable[[], object]] = {"kernel": lambda: causal_attention(q, k, v, scale),
                                              "engine before": lambda: engine_before(q, k, v, scale)}
    if n == m:
        qh = q.transpose(0, 1)[None].contiguous()
        kk, vv = (t.repeat_interleave(HEADS // KV_HEADS, 0)[None] for t in (k, v))
        calls["sdpa"] = lambda: F.scaled_dot_product_attention(qh, kk, vv, is_causal=True, scale=scale)
    pairs = sum(i + (m - n) + 1 for i in range(n))
    return calls, 4.0 * DIM * HEADS * pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, rounds {args.rounds}, heads {HEADS}/{KV_HEADS}, head dim {DIM}, float32")
    for n, m in SHAPES:
        calls, flops = systems(n, m)
        for call in calls.values():  # warm up (and build the kernel)
            call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for round_ in range(args.rounds):
            order = list(calls) if round_ % 2 == 0 else list(reversed(calls))
            for name in order:
                start = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) for name, t in times.items()}
        line = ", ".join(f"{name} {medians[name] * 1e3:.2f} ms ({flops / medians[name] / 1e9:.0f} GFLOP/s)"
                         for name in calls)
        ratios = ", ".join(f"{medians[name] / medians['kernel']:.2f}x vs {name}" for name in calls if name != "kernel")
        print(f"{n} x {m}: {line}; kernel {ratios}")


if __name__ == "__main__":
    main()
