"""What kvforge's Triton kernels share: the optional import of `triton`, whether its
CPU interpreter is on, and the decorator the kernels use.

Importing this module imports triton (when installed), so only the modules that hold
Triton kernels import it, and those are imported only where a kernel may run (a CUDA
tensor, or a test in the interpreter): CPU runs never import triton
(kernels/triton_runtime.py answers whether it is installed without importing it).

TRITON_INTERPRET is read when a kernel is decorated (`triton.jit` decides then), i.e. when
its module is imported: `INTERPRETED` records the setting this module saw, and the kernel
modules are imported after it, in the same process, under the same setting.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from kvforge.kernels.triton_runtime import DECODE_WARPS_ENV, decode_warps

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency: `pip install kvforge[triton]`
    triton = None
    tl = None

__all__ = ["DECODE_WARPS_ENV", "INTERPRETED", "decode_warps", "jit", "tl", "triton", "triton_available",
           "triton_interpreting"]


def triton_available() -> bool:
    """True when `triton` was imported (kernels still need CUDA tensors, or the interpreter)."""
    return triton is not None


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter. `triton.knobs` exists only in
    recent Triton releases; older ones read TRITON_INTERPRET=1 from the environment."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Kernels decorated after this import run interpreted (on CPU tensors) iff this is True.
INTERPRETED = triton_interpreting()

# Without triton a kernel body stays a plain (never called) function, so its module imports.
jit: Callable = triton.jit if triton is not None else (lambda fn: fn)

