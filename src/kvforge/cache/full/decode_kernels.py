"""Which kernel attends `full` decode tokens (`full:decode_kernel=`), resolved once per cache.

- "triton": the paged Triton kernel (triton_decode.py), pages read in place through the
  page table; on CUDA, and on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1,
  how the tests run it). 16/32-bit pages only.
- "gather": one gather of every page and one SDPA call (`gathered_decode_attention`).
- "torch": the tiled PyTorch loop (`decode_attention`), the reference path.
- "auto": "triton" on CUDA when the `triton` package is installed and the pages are
  16/32-bit; otherwise decided per step as before: the compiled CPU kernel for CPU tensors
  (when it builds), on other devices the gathered path while its copy stays bounded
  (`decode_gather_max_bytes`), else the tiled one.

A forced kernel never falls back: `resolve_decode_kernel` checks what "triton" needs
(package, device, page dtype) when the cache is built and raises a ConfigError naming the
rule. triton_decode.py is imported only once a cache resolved to it, so CPU runs never
import triton and importing kvforge does not fix whether the kernel is interpreted.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvforge.errors import ConfigError
from kvforge.kernels.triton_runtime import triton_installed

__all__ = ["resolve_decode_kernel", "triton_module", "triton_store_module"]

INSTALL_TRITON = "pip install 'kvforge[triton]'"


def triton_module() -> ModuleType:
    from kvforge.cache.full import triton_decode

    return triton_decode


def triton_store_module() -> ModuleType:
    """The fused RoPE-and-store (triton_store.py), imported with the decode kernel's rule."""
    from kvforge.cache.full import triton_store

    return triton_store


def resolve_decode_kernel(requested: str, device: torch.device, fp8_pages: bool) -> str:
    """The kernel `requested` (a DECODE_KERNELS value) means for a cache on `device`:
    "triton", "gather", "torch", or "auto" (decided per step, off the Triton kernel)."""
    if requested == "auto":
        return "triton" if device.type == "cuda" and not fp8_pages and triton_installed() else "auto"
    if requested != "triton":
        return requested
    if fp8_pages:
        raise ConfigError("decode_kernel", requested, "reads 16/32-bit pages only; float8 pages (storage_dtype="
                          "float8_*) take decode_kernel=torch, gather or auto")
    if not triton_installed():
        raise ConfigError("decode_kernel", requested, f"needs the `triton` package, which is not installed: "
                          f"{INSTALL_TRITON}")
    if device.type == "cpu":
        from kvforge.kernels.triton_jit import INTERPRETED

        if not INTERPRETED:
            raise ConfigError("decode_kernel", requested, "runs on CUDA; on CPU only in Triton's interpreter, "
                              "which needs TRITON_INTERPRET=1 in the environment before the process starts")
    elif device.type != "cuda":
        raise ConfigError("decode_kernel", requested, f"runs on CUDA (or CPU, interpreted), not {device.type}")
    return requested
