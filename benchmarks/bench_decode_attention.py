"""Per-layer time of batched paged decode attention: PyTorch reference vs the CPU kernel.

    python benchmarks/bench_decode_attention.py [--threads 2] [--dtypes float32,bfloat16,float8_e4m3fn]
        [--layouts scattered,ascending] [--baseline-source OLD.cpp]

Each call reads a different layer of a multi-layer store, so K/V come from memory, not from
cache, as in a real decode step. Page tables are random permutations (`scattered`: pages as
after churn) or runs of adjacent pages (`ascending`: a sequence prefilled into a fresh
pool); the kernel's speed differs by up to ~2.5x between the two. Queries have the storage
dtype where it is 16-bit (as a model of that dtype gives them: bf16 over bf16 pages takes
the kernel's bf16 dot path), else float32. Prints milliseconds per layer and the effective
K+V read bandwidth (float8: codes and their per-row float32 scales).

`--baseline-source` also times another version of cache/full/cpu_decode.cpp (e.g. `git show
HEAD~1:src/kvforge/cache/full/cpu_decode.cpp > old.cpp`), built under a renamed operator
namespace, alternating call by call with the current kernel: the printed ratio is the
median of per-call ratios, so a load change on a shared machine hits both alike. The two
builds are not quite equal: the current source itself, given as the baseline, timed 0.98x
the tree's build on a 2-core Xeon, so ratios within ~2% of 1 say nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from baseline_kernel import build_baseline

from kvforge.cache.attention import decode_attention
from kvforge.cache.full.config import STORAGE_DTYPES
from kvforge.cache.full.cpu_decode import cpu_kernels_available, paged_decode_attention_cpu
from kvforge.cache.full.fp8 import is_fp8, quantize_per_token

LAYOUTS = ("scattered", "ascending")


def make_case(batch: int, context: int, kv_heads: int, heads: int, dim: int, block: int,
              layers: int, dtype: torch.dtype, layout: str) -> dict:
    pages_per_seq = context // block
    num_pages = batch * pages_per_seq + 16
    shape = (layers, kv_heads, num_pages, block, dim)
    k_store, v_store = torch.randn(shape), torch.randn(shape)
    k_scales = v_scales = None
    if is_fp8(dtype):
        (k_store, k_scales), (v_store, v_scales) = (quantize_per_token(x, dtype) for x in (k_store, v_store))
    else:
        k_store, v_store = k_store.to(dtype), v_store.to(dtype)
    order = torch.randperm(num_pages) if layout == "scattered" else torch.arange(num_pages)
    table = order[:batch * pages_per_seq].view(batch, pages_per_seq)
    zeros = torch.zeros(batch, dtype=torch.long)
    query_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    return dict(k_store=k_store, v_store=v_store, k_scales=k_scales, v_scales=v_scales, table=table, first=zeros, visible_from=zeros,
                visible_to=torch.full((batch,), context - 1, dtype=torch.long),
                q=torch.randn(batch, heads, dim).to(query_dtype),
                k_self=torch.randn(batch, kv_heads, dim).to(query_dtype),
                v_self=torch.randn(batch, kv_heads, dim).to(query_dtype))


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


def baseline_op(path: Path) -> Callable:
    """The kernel of another version of cache/full/cpu_decode.cpp (see baseline_kernel.py)."""
    op = build_baseline(path, namespace="kvforge_cpu", op="paged_decode_attention")
    empty = torch.empty(0)

    def call(q, k_self, v_self, k_pages, v_pages, table, first, visible_from, visible_to, scale,
             k_scales=None, v_scales=None):
        return op(q, k_self, v_self, k_pages, v_pages, table, first, visible_from, visible_to, scale,
                  empty if k_scales is None else k_scales, empty if v_scales is None else v_scales)
    return call


def alternate(fns: list[Callable], layers: int, repeats: int) -> list[list[float]]:
    """Seconds per call of each fn, the fns called in turn (order flipped every round). Every
    call reads the next layer of the store, never the one the call before it read (which
    the last-level cache may still hold)."""
    for fn in fns:
        fn(0)
    times: list[list[float]] = [[] for _ in fns]
    call = 0
    for i in range(repeats):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            call += 1
            start = time.perf_counter()
            fns[j](call % layers)
            times[j].append(time.perf_counter() - start)
    return times


def run(batch: int, context: int, kv_heads: int, heads: int, dim: int, block: int, layers: int,
        dtype: torch.dtype, repeats: int, layout: str, baseline: Callable | None) -> None:
    c = make_case(batch, context, kv_heads, heads, dim, block, layers, dtype, layout)
    args = lambda i: (c["q"], c["k_self"], c["v_self"], c["k_store"][i], c["v_store"][i], c["table"],  # noqa: E731
                      c["first"], c["visible_from"], c["visible_to"], dim ** -0.5)
    scales = lambda i: {} if c["k_scales"] is None else {"k_scales": c["k_scales"][i], "v_scales": c["v_scales"][i]}  # noqa: E731
    reference = time_per_layer(lambda i: decode_attention(*args(i), tile_pages=1024 // block, **scales(i)), layers,
                               repeats)
    fns = [lambda i: paged_decode_attention_cpu(*args(i), **scales(i))]
    if baseline is not None:
        fns.append(lambda i: baseline(*args(i), **scales(i)))
    times = alternate(fns, layers, repeats * 4)
    kernel = (statistics.median(times[0]), min(times[0]))
    # bf16 weights on the dot path and 16-bit outputs differ from the float32 reference by
    # the 16-bit rounding; float32 queries must match it closely.
    tolerance = 1e-4 if c["q"].dtype == torch.float32 else 3e-2
    torch.testing.assert_close(paged_decode_attention_cpu(*args(0), **scales(0)).float(),
                               decode_attention(*args(0), tile_pages=64, **scales(0)).float(), atol=tolerance, rtol=0)
    row_bytes = dim * c["k_store"].element_size() + (4 if c["k_scales"] is not None else 0)
    read = 2 * batch * context * kv_heads * row_bytes
    versus = ""
    if baseline is not None:
        ratios = sorted(old / new for new, old in zip(times[0], times[1]))
        versus = f"   baseline {statistics.median(times[1]) * 1e3:6.3f} ms, baseline/kernel {ratios[len(ratios) // 2]:.3f}"
    print(f"B={batch:2d} ctx={context:5d} kv={kv_heads} heads={heads} D={dim} {str(dtype)[6:]:13s} {layout:9s} "
          f"reference {reference[0] * 1e3:7.2f} (min {reference[1] * 1e3:6.2f}) ms   "
          f"kernel {kernel[0] * 1e3:6.3f} (min {kernel[1] * 1e3:6.3f}) ms   "
          f"{read / 1e6:4.0f} MB K+V at {read / kernel[1] / 1e9:4.1f} GB/s, x{reference[1] / kernel[1]:.0f}{versus}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtypes", default="float32,bfloat16", help=f"storage dtypes, of {sorted(STORAGE_DTYPES)}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"page layouts, of {LAYOUTS}")
    parser.add_argument("--baseline-source", default=None, help="another cache/full/cpu_decode.cpp to time too")
    parser.add_argument("--cases", default="all", choices=("all", "batch16"),
                        help="batch16: only the smollm2-135m batch-16 case")
    options = parser.parse_args()
    layouts = options.layouts.split(",")
    for layout in layouts:
        if layout not in LAYOUTS:
            parser.error(f"--layouts: {layout!r} is not one of {LAYOUTS}")
    torch.set_num_threads(options.threads)
    start = time.perf_counter()
    assert cpu_kernels_available(), "the kernel did not build"
    print(f"kernel ready in {time.perf_counter() - start:.1f} s, threads={torch.get_num_threads()}")
    baseline = baseline_op(Path(options.baseline_source)) if options.baseline_source else None
    for dtype in (STORAGE_DTYPES[name] for name in options.dtypes.split(",")):
        for layout in layouts:
            run(16, 1024, 3, 9, 64, 16, 30, dtype, options.repeats, layout, baseline)  # smollm2-135m, batch 16
            if options.cases == "all":
                run(4, 16384, 3, 9, 64, 16, 8, dtype, options.repeats, layout, baseline)
                run(1, 4096, 1, 4, 256, 16, 8, dtype, options.repeats, layout, baseline)  # Gemma3-270m-like


if __name__ == "__main__":
    main()
