"""KIVI's group quantisation on the CPU in one pass, a C++ kernel built at first use.

`quant.quantize_reference` (about ten PyTorch ops, each a pass over the tensor) cost about
0.2 s per 2,048-token prompt on smollm2-135m, bf16, 2 threads: the "rest" of a KIVI prefill
step. `quantize_groups` computes the same result bit for bit (cpu_quant.cpp states the
arithmetic; tests/cache/kivi/test_kivi_cpu_quant.py holds the two together) and returns None
when the call is not eligible: another device, another dtype, autograd needed, or the kernel
unavailable or disabled by `KVFORGE_DISABLE_CPU_KERNELS=1`. The caller then runs the
reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvforge.kernels.build import DEFAULT_FLAG_SETS, FLOAT_IO_DTYPES, CppKernel

__all__ = ["quantize_groups", "quantize_kernel_available"]

# -ffp-contract=off: the code's subtraction and division stay two rounded float32 ops.
_KERNEL = CppKernel(name="kvforge_cpu_kivi_quant", source=Path(__file__).with_name("cpu_quant.cpp"),
                    namespace="kvforge_kivi_quant", op="quantize_groups", what="KIVI quantisation kernel",
                    fallback="the PyTorch quantisation",
                    flag_sets=tuple((*flags, "-ffp-contract=off") for flags in DEFAULT_FLAG_SETS))


def quantize_kernel_available() -> bool:
    """True when the compiled kernel can be used (builds it on the first call; False while
    kernels are disabled, which `CppKernel.available` reads on every call)."""
    return _KERNEL.available()


def quantize_groups(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(packed uint8 [..., n * bits / 8], scale and zero float16 [..., n / group]) of x [..., n]
    grouped along its last dimension, exactly as `quant.quantize_reference`; or None when the
    kernel does not apply (the caller has validated bits and group)."""
    if not x.is_cpu or x.dtype not in FLOAT_IO_DTYPES or x.dim() < 1 or x.numel() == 0:
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    if not quantize_kernel_available():
        return None
    lead, n = x.shape[:-1], x.shape[-1]
    packed, scale, zero = torch.ops.kvforge_kivi_quant.quantize_groups(x.reshape(-1, n).contiguous(), bits, group)
    return packed.view(*lead, -1), scale.view(*lead, -1), zero.view(*lead, -1)
