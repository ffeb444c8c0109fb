"""Per-layer time of batched paged decode attention: PyTorch reference vs the CPU kernel.

    python benchmarks/bench_decode_attention.py [--threads 2] [--dtypes float32,bfloat16,float8_e4m3fn]

Page tables are random permutations (pages scattered, as after churn) and each call reads a
different layer of a multi-layer store, so K/V come from memory, not from cache, as in a
real decode step. Prints milliseconds per layer and the effective K+V read bandwidth
(float8: codes and their per-row float32 scales).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvforge.cache.attention import decode_attention
from kvforge.cache.full.config import STORAGE_DTYPES
from kvforge.cache.full.cpu_decode import cpu_kernels_available, paged_decode_attention_cpu
from kvforge.cache.full.fp8 import is_fp8, quantize_per_token


def make_case(batch: int, context: int, kv_heads: int, heads: int, dim: int, block: int,
              layers: int, dtype: torch.dtype) -> dict:
    pages_per_seq = context // block
    num_pages = batch * pages_per_seq + 16
    shape = (layers, kv_heads, num_pages, block, dim)
    k_store, v_store = torch.randn(shape), torch.randn(shape)
    k_scales = v_scales = None
    if is_fp8(dtype):
        (k_store, k_scales), (v_store, v_scales) = (quantize_per_token(x, dtype) for x in (k_store, v_store))
    else:
        k_store, v_store = k_store.to(dtype), v_store.to(dtype)
    table = torch.randperm(num_pages)[:batch * pages_per_seq].view(batch, pages_per_seq)
    zeros = torch.zeros(batch, dtype=torch.long)
    return dict(k_store=k_store, v_store=v_store, k_scales=k_scales, v_scales=v_scales, table=table, first=zeros, visible_from=zeros,
                visible_to=torch.full((batch,), context - 1, dtype=torch.long),
                q=torch.randn(batch, heads, dim), k_self=torch.randn(batch, kv_heads, dim),
                v_self=torch.randn(batch, kv_heads, dim))


def time_per_layer(fn, layers: int, repeats: int) -> tuple[float, float]:
    """(median, minimum) seconds per call; on a shared machine the minimum is the better
    estimate of the kernel itself."""
    fn(0)  # warm-up
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i % layers)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2], times[0]


def run(batch: int, context: int, kv_heads: int, heads: int, dim: int, block: int, layers: int,
        dtype: torch.dtype, repeats: int) -> None:
    c = make_case(batch, context, kv_heads, heads, dim, block, layers, dtype)
    args = lambda i: (c["q"], c["k_self"], c["v_self"], c["k_store"][i], c["v_store"][i], c["table"],  # noqa: E731
                      c["first"], c["visible_from"], c["visible_to"], dim ** -0.5)
    scales = lambda i: {} if c["k_scales"] is None else {"k_scales": c["k_scales"][i], "v_scales": c["v_scales"][i]}  # noqa: E731
    reference = time_per_layer(lambda i: decode_attention(*args(i), tile_pages=1024 // block, **scales(i)), layers,
                               repeats)
    kernel = time_per_layer(lambda i: paged_decode_attention_cpu(*args(i), **scales(i)), layers, repeats * 4)
    torch.testing.assert_close(paged_decode_attention_cpu(*args(0), **scales(0)),
                               decode_attention(*args(0), tile_pages=64, **scales(0)), atol=1e-4, rtol=0)
    row_bytes = dim * c["k_store"].element_size() + (4 if c["k_scales"] is not None else 0)
    read = 2 * batch * context * kv_heads * row_bytes
    print(f"B={batch:2d} ctx={context:5d} kv={kv_heads} heads={heads} D={dim} {str(dtype)[6:]:13s} "
          f"reference {reference[0] * 1e3:7.2f} (min {reference[1] * 1e3:6.2f}) ms   "
          f"kernel {kernel[0] * 1e3:6.3f} (min {kernel[1] * 1e3:6.3f}) ms   "
          f"{read / 1e6:4.0f} MB K+V at {read / kernel[1] / 1e9:4.1f} GB/s, x{reference[1] / kernel[1]:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtypes", default="float32,bfloat16", help=f"storage dtypes, of {sorted(STORAGE_DTYPES)}")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    start = time.perf_counter()
    assert cpu_kernels_available(), "the kernel did not build"
    print(f"kernel ready in {time.perf_counter() - start:.1f} s, threads={torch.get_num_threads()}")
    for dtype in (STORAGE_DTYPES[name] for name in options.dtypes.split(",")):
        run(16, 1024, 3, 9, 64, 16, 30, dtype, options.repeats)  # smollm2-135m, batch 16
        run(4, 16384, 3, 9, 64, 16, 8, dtype, options.repeats)
        run(1, 4096, 1, 4, 256, 16, 8, dtype, options.repeats)  # Gemma3-270m-like, one sequence


if __name__ == "__main__":
    main()
