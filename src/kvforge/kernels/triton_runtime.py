"""Whether Triton can be used, answered without importing it.

The Triton kernels outside KIVI (kernels/triton_fused.py, cache/full/triton_decode.py) are
decorated through kernels/triton_jit.py, which imports triton and reads TRITON_INTERPRET
once. Their dispatchers (kernels/cuda_fused.py, cache/full/decode_kernels.py) ask only this
module, so CPU runs never import triton, and importing kvforge does not fix whether the
kernels are interpreted (tests/conftest.py sets TRITON_INTERPRET=1 after importing kvforge).
"""

from __future__ import annotations

import functools
import importlib.util
import os

from kvforge.errors import ConfigError

__all__ = ["DECODE_WARPS_ENV", "decode_warps", "triton_installed"]


@functools.cache
def triton_installed() -> bool:
    """Whether the `triton` package can be imported, without importing it."""
    return importlib.util.find_spec("triton") is not None


DECODE_WARPS_ENV = "KVFORGE_TRITON_DECODE_WARPS"
_WARPS = ("1", "2", "4", "8", "16")


def decode_warps() -> int:
    """Warps per program of the decode attention kernels (full, KIVI, ShadowKV's scores and
    attention): Triton's default 4 unless KVFORGE_TRITON_DECODE_WARPS names another count, so
    that a GPU run can time 8 against 4 without an edit (compiled at 4, those kernels spill
    registers at head_dim 128). The interpreter ignores it; an engine on CUDA
    checks it at start-up."""
    raw = os.environ.get(DECODE_WARPS_ENV)
    if raw is None:
        return 4
    if raw.strip() not in _WARPS:
        raise ConfigError(DECODE_WARPS_ENV, raw, f"must be one of {', '.join(_WARPS)} (warps per program of the "
                                                 "Triton decode kernels)")
    return int(raw)
