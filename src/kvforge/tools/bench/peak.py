"""What this machine can do right now, measured in the same run as the benchmark.

- matmul peak: n x n by n x n in the bench dtype at the bench's thread count (n = 2048,
  smaller only where a dtype has no fast CPU kernel, e.g. float16 on most CPUs, so the probe
  stays under about a second), through torch.mm and, where this torch has oneDNN's packed
  linear ops, through the oneDNN product on a prepacked weight that kvforge's CPU prefill
  runs (kernels/cpu_prepack.py), and for bf16 where the engine widens its prefill products
  (kernels/bf16_products.py) that widened form: the fastest of them, so that no engine step
  can beat its own roofline (torch.mm's BLAS can be far from the machine's best: in float32 on the 2-core
  EPYC it measured about half of oneDNN's). Reported as the best of the repeats, in GFLOP/s:
  a peak, not a typical value; `matmul_kernel` names the product that set it.
- read bandwidth: torch.sum over a 256 MiB float32 tensor (far larger than the caches), in
  GB/s: the median of READ_PASSES passes (the best pass is kept as `read_gbps_best`). Decode
  is bound by reading weights and KV, so its GB/s are compared with this. Not the best pass:
  on this shared machine a single pass now and then reads far above the rest, and a
  best-of-5 rule turned that into the roofline of a whole run
  (docs/benchmarks.md#measurements-behind-design-choices). The decode figures compared with
  it are medians too.

Both are taken before any system runs; on a machine shared with other jobs they move with
the load, which is why they are measured here rather than quoted. On the CPU the read probe
runs again after the last system (`with_read_after`), and `read_gbps` becomes the median of
the passes of both probes. The bandwidth of the 2-core VM this was built on moved across
back-to-back decode runs, and more within single runs (before and after), so one probe
before a several-minute run could misstate its "fraction of the read bandwidth"
(docs/benchmarks.md#measurements-behind-design-choices). Both probes' medians are kept
(`read_gbps_before`, `read_gbps_after`), so a run whose machine changed under it shows it.

On a GPU (`device`), both are measured there, the bench's roofline being the GPU's: the
matmul at n = 8192 and the read over 2 GiB (the CPU's probe sizes fit in an H100's L2 or
finish in microseconds), each timed between two synchronisations, best of the repeats (a
lent GPU runs nothing else).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from kvforge.errors import require
from kvforge.kernels.bf16_products import bf16_products
from kvforge.kernels.cpu_prepack import onednn_packs, packed_linear, prepack_available, prepack_weights

MATMUL_SIZE = 2048
PROBE_SECONDS = 0.05  # a smaller size is used when one 2048 call would take far longer
READ_BYTES = 256 * 2**20
READ_PASSES = 9
DEVICE_MATMUL_SIZE = 8192
DEVICE_READ_BYTES = 2 * 2**30


@dataclass(frozen=True)
class MachinePeak:
    matmul_gflops: float
    matmul_size: int
    matmul_dtype: str
    read_gbps: float
    threads: int
    device: str = "cpu"
    read_gbps_best: float | None = None  # the fastest read pass (CPU probe; None on a GPU)
    # CPU only: every read pass in GB/s, in order (the probe before the systems, then the one
    # after them once `with_read_after` has run), and each probe's median.
    read_passes_gbps: tuple[float, ...] = ()
    read_gbps_before: float | None = None
    read_gbps_after: float | None = None
    matmul_kernel: str = "torch.mm"  # the product that set matmul_gflops (`_matmul_products`)

    def as_dict(self) -> dict[str, float | int | str | None]:
        return asdict(self)


def _no_sync() -> None:
    pass


def _timed_passes(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = _no_sync) -> list[float]:
    """Wall times of `repeats` calls of `fn` after one warm-up call (thread pool start,
    allocator, kernel selection); `sync` waits for queued device work (nothing on the CPU)."""
    fn()
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds


def _best_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = _no_sync) -> float:
    return min(_timed_passes(fn, repeats, sync))


def _matmul_size(dtype: torch.dtype) -> int:
    """Largest power of two <= MATMUL_SIZE whose matmul (extrapolated from a smaller one)
    stays within a few PROBE_SECONDS."""
    size = 256
    while size < MATMUL_SIZE:
        a = torch.randn(size, size).to(dtype)
        if _best_seconds(lambda a=a: torch.mm(a, a), 1) * 8 > 20 * PROBE_SECONDS:
            break
        size *= 2
    return size


def _matmul_products(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The products a @ b is timed through: torch.mm, and oneDNN on b prepacked (as a linear
    weight, b^T) where this torch and CPU offer it for the dtype, and the engine's widened
    bf16 form where it would take it."""
    products: dict[str, Callable[[], object]] = {"torch.mm": lambda: torch.mm(a, b)}
    if onednn_packs(a.dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(b.T.contiguous(), None)
        products["oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    if a.dtype == torch.bfloat16 and prepack_available() and bf16_products().linear:  # the engine's bf16 prefill form
        weight = b.T.contiguous()
        if prepack_weights([weight], "on", None, widen_bf16=True).widened:
            products["oneDNN packed, bf16 widened to float32"] = lambda: packed_linear(a, weight, None)
    return products


def measure_matmul_gflops(dtype: torch.dtype, repeats: int = 5) -> tuple[float, int, str]:
    """(GFLOP/s, n, the product that set it): the fastest of `_matmul_products`."""
    size = _matmul_size(dtype)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    seconds = {name: _best_seconds(product, repeats) for name, product in _matmul_products(a, b).items()}
    kernel = min(seconds, key=seconds.__getitem__)
    return 2 * size**3 / seconds[kernel] / 1e9, size, kernel


def measure_read_passes(passes: int = READ_PASSES) -> list[float]:
    """GB/s of each of `passes` torch.sum passes over READ_BYTES, in order."""
    require(passes >= 1, "passes", passes, "must be at least 1")
    data = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    return [READ_BYTES / seconds / 1e9 for seconds in _timed_passes(lambda: data.sum(), passes)]


def median_pass(gbps: list[float] | tuple[float, ...]) -> float:
    """The median of measured passes, itself a measured pass (the upper one for an even
    count), as bench's repeats use."""
    ordered = sorted(gbps)
    return ordered[len(ordered) // 2]


def with_read_after(peak: MachinePeak, passes: int = READ_PASSES) -> MachinePeak:
    """`peak` with a second read probe, taken now (after the systems ran): read_gbps becomes
    the median of both probes' passes, read_gbps_best the best of them. A GPU peak (best of
    its repeats, on a lent machine that runs nothing else) is returned unchanged."""
    if peak.device != "cpu" or not peak.read_passes_gbps:
        return peak
    after = measure_read_passes(passes)
    every = (*peak.read_passes_gbps, *after)
    return replace(peak, read_gbps=median_pass(every), read_gbps_best=max(every), read_passes_gbps=every,
                   read_gbps_after=median_pass(after))


def measure_device_peak(dtype: torch.dtype, device: torch.device, repeats: int = 5) -> tuple[float, float]:
    """(matmul GFLOP/s, read GB/s) on an accelerator; its memory is returned afterwards."""
    def sync() -> None:
        torch.cuda.synchronize(device)

    def matmul_seconds() -> float:
        a = torch.randn(DEVICE_MATMUL_SIZE, DEVICE_MATMUL_SIZE, device=device).to(dtype)
        b = torch.randn(DEVICE_MATMUL_SIZE, DEVICE_MATMUL_SIZE, device=device).to(dtype)
        return _best_seconds(lambda: torch.mm(a, b), repeats, sync)

    def read_seconds() -> float:
        data = torch.rand(DEVICE_READ_BYTES // 4, device=device)
        return _best_seconds(lambda: data.sum(), repeats, sync)

    gflops = 2 * DEVICE_MATMUL_SIZE**3 / matmul_seconds() / 1e9
    gbps = DEVICE_READ_BYTES / read_seconds() / 1e9
    torch.cuda.empty_cache()
    return gflops, gbps


def measure_peak(dtype: torch.dtype, device: torch.device | None = None) -> MachinePeak:
    name = str(dtype).removeprefix("torch.")
    if device is not None and device.type == "cuda":
        gflops, gbps = measure_device_peak(dtype, device)
        return MachinePeak(matmul_gflops=gflops, matmul_size=DEVICE_MATMUL_SIZE, matmul_dtype=name,
                           read_gbps=gbps, threads=torch.get_num_threads(), device=str(device))
    gflops, size, kernel = measure_matmul_gflops(dtype)
    passes = measure_read_passes()
    read = median_pass(passes)
    return MachinePeak(matmul_gflops=gflops, matmul_size=size, matmul_dtype=name, read_gbps=read, matmul_kernel=kernel,
                       threads=torch.get_num_threads(), read_gbps_best=max(passes),
                       read_passes_gbps=tuple(passes), read_gbps_before=read)
