"""Build every C++ CPU kernel before a measurement, so that no compile is ever timed.

Each kernel builds lazily at its first use (`kvforge.kernels.build.CppKernel`). In a
benchmark that first use can fall inside a timed region: with `--warmup 0`, ShadowKV's first
decode step once included a whole compile
(docs/benchmarks.md#measurements-behind-design-choices). `build_cpu_kernels` triggers all
the builds up front; a kernel that cannot be built is reported unavailable exactly as at
first use (its PyTorch fallback is what the measurement then runs). `make setup` also builds
optimum-quanto's extension, which the `hf-quanto` evaluation peer would otherwise compile
in a user's first such command.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvforge.cache.full.cpu_decode import cpu_kernels_available
from kvforge.cache.kivi.cpu_decode import cpu_kivi_kernel_available
from kvforge.cache.kivi.cpu_quant import quantize_kernel_available
from kvforge.cache.shadowkv.cpu_decode import cpu_shadowkv_kernel_available
from kvforge.kernels.cpu_causal_attention import causal_attention_runs
from kvforge.kernels.cpu_decode_layer import decode_layer_available
from kvforge.kernels.cpu_fused import fused_ops_available
from kvforge.kernels.cpu_linear import small_m_linear_available

__all__ = ["CPU_KERNELS", "build_cpu_kernels", "build_quanto_extension"]

# Display name -> availability check (which builds on its first call and caches the result).
CPU_KERNELS: dict[str, Callable[[], bool]] = {
    "paged attention": cpu_kernels_available,
    "KIVI attention": cpu_kivi_kernel_available,
    "KIVI quantisation": quantize_kernel_available,
    "ShadowKV decode": cpu_shadowkv_kernel_available,
    "small-M linear": small_m_linear_available,
    "fused RMSNorm/RoPE": fused_ops_available,
    "causal attention": causal_attention_runs,
    "fused decoder layer": decode_layer_available,  # after the ops it calls (it checks them too)
}


def build_cpu_kernels() -> tuple[dict[str, bool], float]:
    """Build (or load the cached build of) every CPU kernel; return availability and seconds."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    # Each build is a compiler subprocess: two at a time use two cores (each kernel has its
    # own build directory and lock, so they do not wait for each other).
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(check) for name, check in CPU_KERNELS.items()}
    available = {name: future.result() for name, future in futures.items()}
    return available, time.perf_counter() - start


def build_quanto_extension() -> str:
    """optimum-quanto (the `hf-quanto` peer of `kvforge eval`, installed with kvforge's
    `quanto` extra) compiles its C++ extension into its own package on its first use: build
    it now too. What became of it, in words; never raises (the peer reports its own errors)."""
    import importlib.util

    try:
        if importlib.util.find_spec("optimum.quanto") is None:
            return "not installed"
        from optimum.quanto.library.extensions import get_extension

        get_extension("quanto_cpp").lib  # noqa: B018 (loading is building)
    except Exception as error:  # a compiler or package problem: the first use will say it again
        return f"not built ({type(error).__name__}: {str(error)[:200]})"
    return "ready"


def main() -> int:
    """`python -m kvforge.prebuild` (run by `make setup`): build every kernel now, so a
    user's first command compiles nothing."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    available, seconds = build_cpu_kernels()
    for name, ok in available.items():
        print(f"kvforge kernel {name}: {'ready' if ok else 'unavailable (PyTorch fallback)'}")
    print(f"kvforge kernels checked in {seconds:.1f} s")
    start = time.perf_counter()
    print(f"optimum-quanto's C++ extension: {build_quanto_extension()} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
