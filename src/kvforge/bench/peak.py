"""What this machine can do right now, measured in the same run as the benchmark.

- matmul peak: torch.mm of two n x n matrices in the bench dtype at the bench's thread
  count (n = 2048, smaller only where a dtype has no fast CPU kernel, e.g. float16 on most
  CPUs, so the probe stays under about a second). Reported as the best of the repeats, in
  GFLOP/s: a peak, not a typical value.
- read bandwidth: torch.sum over a 256 MiB float32 tensor (far larger than the caches),
  best of the repeats, in GB/s. Decode is bound by reading weights and KV, so its GB/s are
  compared with this.

Both are taken before any system runs; on a machine shared with other jobs they move with
the load, which is why they are measured here rather than quoted.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

MATMUL_SIZE = 2048
PROBE_SECONDS = 0.05  # a smaller size is used when one 2048 call would take far longer
READ_BYTES = 256 * 2**20


@dataclass(frozen=True)
class MachinePeak:
    matmul_gflops: float
    matmul_size: int
    matmul_dtype: str
    read_gbps: float
    threads: int

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: thread pool start, allocator, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


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


def measure_matmul_gflops(dtype: torch.dtype, repeats: int = 5) -> tuple[float, int]:
    size = _matmul_size(dtype)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b), repeats)
    return 2 * size**3 / seconds / 1e9, size


def measure_read_gbps(repeats: int = 5) -> float:
    data = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    seconds = _best_seconds(lambda: data.sum(), repeats)
    return READ_BYTES / seconds / 1e9


def measure_peak(dtype: torch.dtype) -> MachinePeak:
    gflops, size = measure_matmul_gflops(dtype)
    return MachinePeak(matmul_gflops=gflops, matmul_size=size, matmul_dtype=str(dtype).removeprefix("torch."),
                       read_gbps=measure_read_gbps(), threads=torch.get_num_threads())
