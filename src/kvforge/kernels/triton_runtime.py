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

__all__ = ["triton_installed"]


@functools.cache
def triton_installed() -> bool:
    """Whether the `triton` package can be imported, without importing it."""
    return importlib.util.find_spec("triton") is not None
