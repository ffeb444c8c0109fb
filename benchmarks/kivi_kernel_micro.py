"""Decode attention cost per (token, kv head): the CPU KIVI kernel against the full-precision
paged CPU kernel on the same sequences, timed alternately in one process.

    python benchmarks/kivi_kernel_micro.py [--threads 2 1] [--batch 16] [--context 2048]
        [--repeats 15] [--baseline-source OLD.cpp] [--pre-rope] [--int8-keys] [--int8-values]
        [--methods REGEX]

Geometry defaults to smollm2-135m (3 kv heads, 9 query heads, head_dim 64) with KIVI's
G=32, R=128. Every method gets a store of `--layers` layers (more than the last-level
cache holds) and each call reads the next layer, so pages come from memory as in a real
decode step; page tables are random permutations (pages scattered, as after churn).
Lengths are `context + (37 b mod R)`, so the sequences hold residuals of different sizes.

The methods run in turn, call by call, so a load change on the shared machine hits all of
them alike: the ratios kivi/full of one run are the figures to compare. `--baseline-source`
also times another version of `cache/kivi/cpu_decode.cpp` (e.g. `git show HEAD:...`), built
under a renamed operator namespace, for before/after numbers in the same run. `--pre-rope`
also times each bit width with its stored keys taken as pre-RoPE (`kivi:key_space=pre_rope`:
the kernel RoPEs every key after dequantising it). `--int8-keys` also times each bit width
with `kivi:key_dot=int8` (scaled query quantised to int8 per page, VNNI integer sums);
`--int8-values` with `kivi:key_dot=int8,value_dot=int8` (softmax weights quantised too).

On a machine shared with other work, run it with OMP_WAIT_POLICY=PASSIVE: OpenMP threads
that spin while a sibling waits for a core made every 2-thread timing here 5x the 1-thread
one (measured on a 2-core VM at load ~3-7), whatever the kernel. Set it for this command
only, never in the shell: `kvforge bench` runs under it are 1.4x slower for memory-bound
systems and are flagged (`sleeping_threads`).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from baseline_kernel import build_baseline

from kvforge.cache.full.cpu_decode import cpu_kernels_available, paged_decode_attention_cpu
from kvforge.cache.kivi.attention import kivi_decode_attention
from kvforge.cache.kivi.cpu_decode import (
    KEY_DOT_CODES,
    VALUE_DOT_CODES,
    cpu_kivi_kernel_available,
    kivi_decode_attention_cpu,
)
from kvforge.cache.kivi.key_space import StoredKeys
from kvforge.cache.kivi.store import KIVILayerView
from kvforge.config import RopeConfig
from kvforge.rope import RotaryEmbedding

FULL_BLOCK = 16  # FullCache's default block_size


def kivi_store(layers: int, kv_heads: int, pages: int, dim: int, g: int, bits: int, slots: int, residual: int,
               residual_dtype: torch.dtype) -> list[KIVILayerView]:
    """Random but valid KIVI tensors (any byte is a valid packed code), one view per layer."""
    def half(*shape: int, low: float, high: float) -> torch.Tensor:
        return (torch.rand(shape) * (high - low) + low).to(torch.float16)

    k_codes = torch.randint(0, 256, (layers, kv_heads, pages, dim, g * bits // 8), dtype=torch.uint8)
    v_codes = torch.randint(0, 256, (layers, kv_heads, pages, g, dim * bits // 8), dtype=torch.uint8)
    k_scale, k_zero = half(layers, kv_heads, pages, dim, low=0.05, high=0.5), half(layers, kv_heads, pages, dim,
                                                                                   low=-2, high=0)
    v_scale = half(layers, kv_heads, pages, g, dim // g, low=0.05, high=0.5)
    v_zero = half(layers, kv_heads, pages, g, dim // g, low=-2, high=0)
    k_res = torch.randn(layers, slots, kv_heads, residual, dim).to(residual_dtype)
    v_res = torch.randn(layers, slots, kv_heads, residual, dim).to(residual_dtype)
    return [KIVILayerView(k_codes[i], k_scale[i], k_zero[i], v_codes[i], v_scale[i], v_zero[i], k_res[i], v_res[i],
                          bits) for i in range(layers)]


def make_inputs(options: argparse.Namespace) -> dict:
    batch, heads, kv_heads, dim = options.batch, options.heads, options.kv_heads, options.dim
    g, residual = options.group, options.residual
    lengths = torch.tensor([options.context + (37 * b) % residual for b in range(batch)])
    nk = (lengths // residual) * residual
    columns = int(nk.max()) // g
    kivi_pages = batch * columns + 8
    kivi_table = torch.randperm(kivi_pages)[:batch * columns].view(batch, columns)
    full_columns = -(-int(lengths.max()) // FULL_BLOCK)
    full_pages = batch * full_columns + 8
    full_table = torch.randperm(full_pages)[:batch * full_columns].view(batch, full_columns)
    zeros = torch.zeros(batch, dtype=torch.long)
    return dict(lengths=lengths, zeros=zeros, kivi_pages=kivi_pages, kivi_table=kivi_table, full_pages=full_pages,
                full_table=full_table, slots=torch.arange(batch), q=torch.randn(batch, heads, dim),
                k_self=torch.randn(batch, kv_heads, dim), v_self=torch.randn(batch, kv_heads, dim))


def baseline_op(path: Path) -> Callable:
    """The kernel of another version of the source, under the namespace kvforge_cpu_kivi_baseline."""
    op = build_baseline(path, namespace="kvforge_cpu_kivi", op="kivi_decode_attention")

    def call(q, k_self, v_self, view, page_table, first, visible_from, lengths, slots, scale, key_dot="float",
             value_dot="float"):
        dots = () if key_dot == value_dot == "float" else (
            None, None, 0, None, None, KEY_DOT_CODES[key_dot], VALUE_DOT_CODES[value_dot])
        return op(q, k_self, v_self, view.k_codes, view.k_scale, view.k_zero, view.v_codes, view.v_scale,
                  view.v_zero, view.k_res, view.v_res, page_table, first, visible_from, lengths, slots, scale,
                  view.bits, *dots)
    return call


def build_methods(options: argparse.Namespace, x: dict) -> dict[str, tuple[Callable[[int], torch.Tensor], Callable]]:
    """name -> (call on layer i, PyTorch reference on layer i)."""
    batch, kv_heads, dim, layers = options.batch, options.kv_heads, options.dim, options.layers
    scale = dim ** -0.5
    methods: dict[str, tuple[Callable, Callable]] = {}
    for dtype in (torch.float16, torch.float32):
        shape = (layers, kv_heads, x["full_pages"], FULL_BLOCK, dim)
        k_store, v_store = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)

        def full(i: int, k_store=k_store, v_store=v_store) -> torch.Tensor:
            return paged_decode_attention_cpu(x["q"], x["k_self"], x["v_self"], k_store[i], v_store[i],
                                              x["full_table"], x["zeros"], x["zeros"], x["lengths"], scale)
        methods[f"full-{str(dtype)[6:]}"] = (full, None)
    baseline = baseline_op(Path(options.baseline_source)) if options.baseline_source else None
    for bits in options.bits:
        views = kivi_store(layers, kv_heads, x["kivi_pages"], dim, options.group, bits, batch, options.residual,
                           getattr(torch, options.residual_dtype))

        def args(i: int, views=views) -> tuple:
            return (x["q"], x["k_self"], x["v_self"], views[i], x["kivi_table"], x["zeros"], x["zeros"],
                    x["lengths"], x["slots"], scale)

        def reference(i: int, args=args) -> torch.Tensor:
            return kivi_decode_attention(*args(i), tile_pages=8)
        methods[f"kivi-{bits}"] = (lambda i, args=args: kivi_decode_attention_cpu(*args(i)), reference)
        if baseline is not None:
            methods[f"kivi-{bits}-baseline"] = (lambda i, args=args: baseline(*args(i)), reference)
        if options.int8_keys:
            methods[f"kivi-{bits}-int8"] = (
                lambda i, args=args: kivi_decode_attention_cpu(*args(i), key_dot="int8"),
                lambda i, args=args: kivi_decode_attention(*args(i), tile_pages=8, key_dot="int8"))
        if options.int8_values:
            methods[f"kivi-{bits}-int8-kv"] = (
                lambda i, args=args: kivi_decode_attention_cpu(*args(i), key_dot="int8", value_dot="int8"),
                lambda i, args=args: kivi_decode_attention(*args(i), tile_pages=8, key_dot="int8", value_dot="int8"))
            if baseline is not None:
                methods[f"kivi-{bits}-int8-kv-baseline"] = (
                    lambda i, args=args: baseline(*args(i), key_dot="int8", value_dot="int8"),
                    methods[f"kivi-{bits}-int8-kv"][1])
        if options.pre_rope:
            keys = StoredKeys(RotaryEmbedding(dim, RopeConfig(theta=10000.0)))
            tables = keys.rope_tables(int(x["lengths"].max()))
            methods[f"kivi-{bits}-pre_rope"] = (
                lambda i, args=args, tables=tables: kivi_decode_attention_cpu(*args(i), rope_tables=tables),
                lambda i, args=args, keys=keys: kivi_decode_attention(*args(i), tile_pages=8, key_transform=keys))
    return methods


def measure(methods: dict, layers: int, repeats: int) -> dict[str, tuple[float, float, float]]:
    """(median wall, minimum wall, median CPU) seconds per call of each method, the methods
    called in turn (rotating order). CPU time is the process's: with one thread it is the
    kernel's own work, unaffected by the time other processes hold the core."""
    names = list(methods)
    for name in names:
        methods[name][0](0)  # warm-up (and build)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            start, start_cpu = time.perf_counter(), time.process_time()
            methods[name][0]((r * len(names) + k) % layers)
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    return {name: (statistics.median(wall[name]), min(wall[name]), statistics.median(cpu[name])) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--residual", type=int, default=128)
    parser.add_argument("--residual-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=16, help="layers per store (reads cycle through them)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--baseline-source", default=None, help="another cache/kivi/cpu_decode.cpp to time too")
    parser.add_argument("--pre-rope", action="store_true", help="also time pre-RoPE stored keys")
    parser.add_argument("--int8-keys", action="store_true", help="also time kivi:key_dot=int8 (integer-domain scores)")
    parser.add_argument("--int8-values", action="store_true",
                        help="also time kivi:key_dot=int8,value_dot=int8 (integer-domain scores and value sums)")
    parser.add_argument("--methods", default=None, help="time only the methods whose name matches this regex")
    options = parser.parse_args()
    assert cpu_kernels_available() and cpu_kivi_kernel_available(), "a CPU kernel did not build"
    torch.manual_seed(0)
    x = make_inputs(options)
    methods = build_methods(options, x)
    if options.methods:
        methods = {name: m for name, m in methods.items() if re.fullmatch(options.methods, name)}
    for name, (call, reference) in methods.items():
        if reference is not None:
            torch.testing.assert_close(call(0), reference(0), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, name=name: f"{name}: {m}")
    token_heads = int(x["lengths"].sum()) * options.kv_heads
    print(f"B={options.batch} context~{options.context} kv_heads={options.kv_heads} heads={options.heads} "
          f"D={options.dim} G={options.group} R={options.residual} residual={options.residual_dtype} "
          f"layers={options.layers} repeats={options.repeats}; ns per (token, kv head)")
    for threads in options.threads:
        torch.set_num_threads(threads)
        timings = measure(methods, options.layers, options.repeats)
        for column, label in enumerate(("wall median", "wall min", "CPU median")):
            ns = {name: values[column] * 1e9 / token_heads for name, values in timings.items()}
            row = "  ".join(f"{name} {value:6.2f}" for name, value in ns.items())
            ratios = "  ".join(f"{name}/{full} {ns[name] / ns[full]:.2f}" for name in ns if name.startswith("kivi")
                               for full in ns if full.startswith("full"))
            ratios += "".join(f"  {name[:-len('-baseline')]}/baseline {ns[name[:-len('-baseline')]] / ns[name]:.3f}"
                              for name in ns if name.endswith("-baseline") and name[:-len("-baseline")] in ns)
            print(f"threads={threads} {label:11s}: {row}\n{'':23s}{ratios}")


if __name__ == "__main__":
    main()
