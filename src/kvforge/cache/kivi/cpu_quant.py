"""KIVI's group quantisation on the CPU in one pass, and a decode step's writes, a C++ kernel
built at first use.

`quant.quantize_reference` (about ten PyTorch ops, each a pass over the tensor) was the
"rest" of a KIVI prefill step (docs/benchmarks.md#measurements-behind-design-choices).
`quantize_groups` computes the same result bit for bit (cpu_quant.cpp states the arithmetic;
tests/cache/kivi/test_kivi_cpu_quant.py holds the two together) and returns None when the
call is not eligible: another device, another dtype, autograd needed, or the kernel
unavailable or disabled by `KVFORGE_DISABLE_CPU_KERNELS=1`. The caller then runs the
reference.

`flush_value_tokens` and `write_ring_rows` are what `step_writes.py` does at the end of a
step (values leaving the residual rings quantised into their pages; the step's rows written
into the rings), for every layer in one call each. Their PyTorch expressions are a gather, a
stack, three index copies and two indexed writes per ring, each a dispatch and an
allocation, in every decode step (docs/benchmarks.md#measurements-behind-design-choices);
the ops write the same bytes in place and return False when not eligible, and the caller
then runs the expressions.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvforge.kernels.build import DEFAULT_FLAG_SETS, FLOAT_IO_DTYPES, CppKernel

__all__ = ["flush_value_tokens", "quantize_groups", "quantize_kernel_available", "write_ring_rows"]

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


def _all_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.is_cpu for t in tensors)


def _plain_indices(*indices: torch.Tensor) -> bool:
    """Contiguous int64 vectors, as the ops read them (plan tensors are)."""
    return all(i.dtype == torch.long and i.dim() == 1 and i.is_contiguous() for i in indices)


def flush_value_tokens(v_res: torch.Tensor, res_layers: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor,
                       order: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                       flat_slots: torch.Tensor, bits: int, group: int) -> bool:
    """Quantise, for page layer j and token i, the ring row v_res[res_layers[j], slots[order[i]], :,
    offsets[order[i]]] per `group` channels into page slot flat_slots[i] of v_codes[j] (and
    v_scale[j], v_zero[j]), in place; False (nothing written) when the kernel does not apply."""
    if not _all_cpu(v_res, v_codes, v_scale, v_zero) or v_res.dtype not in FLOAT_IO_DTYPES:
        return False
    if not all(t.is_contiguous() for t in (v_res, v_codes, v_scale, v_zero)):
        return False
    if not _plain_indices(res_layers, slots, offsets, order, flat_slots):
        return False
    if not quantize_kernel_available():
        return False
    torch.ops.kvforge_kivi_quant.flush_value_tokens(v_res, res_layers, slots, offsets, order, v_codes, v_scale,
                                                    v_zero, flat_slots, bits, group)
    return True


def write_ring_rows(ring: torch.Tensor, res_layers: torch.Tensor, rows: list[torch.Tensor], src: torch.Tensor,
                    slots: torch.Tensor, offsets: torch.Tensor) -> bool:
    """ring[res_layers[j], slots[i], :, offsets[i]] = rows[j][src[i]] in the ring's dtype, in
    place; False (nothing written) when the kernel does not apply."""
    if not rows or not _all_cpu(ring, *rows) or ring.dtype not in FLOAT_IO_DTYPES:
        return False
    if rows[0].dtype not in FLOAT_IO_DTYPES or not ring.is_contiguous():
        return False
    if any(r.dtype != rows[0].dtype or r.dim() != 3 or r.shape != rows[0].shape or not r.is_contiguous()
           for r in rows):
        return False
    if not _plain_indices(res_layers, src, slots, offsets):
        return False
    if torch.is_grad_enabled() and any(r.requires_grad for r in rows):
        return False
    if not quantize_kernel_available():
        return False
    torch.ops.kvforge_kivi_quant.write_ring_rows(ring, res_layers, rows, src, slots, offsets)
    return True
