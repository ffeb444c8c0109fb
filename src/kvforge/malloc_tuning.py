"""glibc's malloc told to keep freed memory for reuse, for CPU inference.

A prefill step allocates and frees hundreds of MiB of activations (each layer's q/k/v and
MLP products for 2,048 rows). With glibc's defaults a freed block above the mmap threshold
goes back to the OS, and the heap top is trimmed, so the next step touches fresh pages
again: hundreds of thousands of page faults over a served burst (docs/benchmarks.md).
Fixed thresholds (`mallopt`, which also stops glibc from moving them) keep those blocks:
up to 32 MiB each comes from the heap, and the heap is trimmed only beyond 1 GiB free.

The cost is memory that stays with the process after a peak, at most about the largest
step's activations. `KVFORGE_MALLOC_TUNING=off` leaves glibc's defaults; so does a
`GLIBC_TUNABLES` that sets any `glibc.malloc` tunable (the user's choice wins), and any C
library without `mallopt`.
"""

from __future__ import annotations

import ctypes
import os
import sys

ENV_SWITCH = "KVFORGE_MALLOC_TUNING"
M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest on 64-bit machines
TRIM_THRESHOLD_BYTES = 2**30

_outcome: str | None = None


def keep_freed_memory() -> str:
    """Apply the thresholds once per process; returns what was done, for the start-up log."""
    global _outcome
    if _outcome is None:
        _outcome = _apply()
    return _outcome


def _apply() -> str:
    switch = os.environ.get(ENV_SWITCH, "on").strip().lower()
    if switch in ("off", "0", "false", "no"):
        return f"malloc: glibc's defaults ({ENV_SWITCH}={switch})"
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "malloc: as GLIBC_TUNABLES sets it"
    mallopt = _mallopt()
    if mallopt is None:
        return "malloc: the C library's defaults (no mallopt)"
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        return "malloc: the C library's defaults (mallopt refused the thresholds)"
    return (f"malloc: freed blocks up to {MMAP_THRESHOLD_BYTES // 2**20} MiB kept for reuse (fewer page faults; "
            f"{ENV_SWITCH}=off for glibc's defaults)")


def _mallopt():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int)
    function.restype = ctypes.c_int
    return function
