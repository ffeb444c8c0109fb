"""Asymmetric group quantisation and bit packing (the arithmetic of KIVI).

A *group* is `group` consecutive elements along the last dimension of a tensor. Each group
gets its own zero point and scale, both stored in float16:

    zero  = min(group)                      (rounded *down* to a float16)
    scale = (max(group) - zero) / (2^bits - 1)   (rounded *up* to a float16)
    code  = clamp(round((x - zero) / scale), 0, 2^bits - 1)
    x_hat = zero + code * scale

Rounding zero down and scale up keeps every element inside the representable range
[zero, zero + (2^bits - 1) * scale] after the float16 rounding, so round-to-nearest bounds
the error of every element by scale / 2 (the guarantee tests check).

Codes are packed little-end-first into bytes: 8 // bits codes per uint8 along the last
dimension (code i of a byte sits at bits [i * bits, (i + 1) * bits)). Bytes rather than
32-bit words keep unpacking a shift-and-mask that every backend (PyTorch, C++, Triton)
does the same way.

Which axis is grouped is the caller's choice: KIVI groups keys along tokens (per channel)
and values along channels (per token); both reduce to "the last dimension" here after a
transpose.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.cache.kivi.cpu_quant import quantize_groups
from kvforge.errors import require
from kvforge.host_sync import host_memory

SUPPORTED_BITS = (2, 4, 8)
PARAM_DTYPE = torch.float16  # dtype of the per-group scale and zero point


def codes_per_byte(bits: int) -> int:
    require(bits in SUPPORTED_BITS, "bits", bits, f"must be one of {list(SUPPORTED_BITS)}")
    return 8 // bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] (each < 2^bits) -> packed uint8 [..., n * bits / 8]."""
    per_byte = codes_per_byte(bits)
    n = codes.shape[-1]
    require(n % per_byte == 0, "packed length", n, f"must be a multiple of {per_byte} for {bits}-bit codes")
    if per_byte == 1:
        return codes.to(torch.uint8).contiguous()
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], n // per_byte, per_byte)
    packed = grouped[..., 0].clone()
    for i in range(1, per_byte):
        packed |= grouped[..., i] << (i * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed uint8 [..., m] -> uint8 codes [..., m * 8 / bits]."""
    per_byte = codes_per_byte(bits)
    if per_byte == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


@dataclass
class QuantizedGroups:
    """Groups along the last dimension of a tensor of shape [..., n].

    packed: uint8 [..., n * bits / 8]; scale, zero: float16 [..., n / group]."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int

    @property
    def length(self) -> int:
        return self.packed.shape[-1] * codes_per_byte(self.bits)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


def _round_toward(target: torch.Tensor, direction: float) -> torch.Tensor:
    """float16 of `target` that is <= target (direction -inf) or >= target (+inf)."""
    rounded = target.to(PARAM_DTYPE)
    wrong = rounded.float() > target if direction < 0 else rounded.float() < target
    # Skipping the fix when nothing is wrong reads the device: on host memory only (host_sync).
    if not host_memory(target.device) or bool(wrong.any()):
        towards = torch.full_like(rounded, direction)
        rounded = torch.where(wrong, torch.nextafter(rounded, towards), rounded)
    return rounded


def quantize(x: torch.Tensor, bits: int, group: int) -> QuantizedGroups:
    """Quantise `x` [..., n] in groups of `group` along the last dimension (n % group == 0).
    On the CPU the compiled kernel (cpu_quant.py) computes it in one pass, bit for bit as
    `quantize_reference`, which runs everywhere else."""
    per_byte = codes_per_byte(bits)
    n = x.shape[-1]
    require(group > 0 and n % group == 0, "group", group, f"must divide the quantised length {n}")
    require(n % per_byte == 0, "packed length", n, f"must be a multiple of {per_byte} for {bits}-bit codes")
    fast = quantize_groups(x, bits, group)
    if fast is not None:
        return QuantizedGroups(*fast, bits, group)
    return quantize_reference(x, bits, group)


def quantize_reference(x: torch.Tensor, bits: int, group: int) -> QuantizedGroups:
    """The definition `quantize` follows, in PyTorch ops (any device, dtype and autograd);
    arguments validated by `quantize`."""
    n = x.shape[-1]
    levels = (1 << bits) - 1
    xg = x.float().reshape(*x.shape[:-1], n // group, group)
    low = xg.amin(dim=-1)
    high = xg.amax(dim=-1)
    zero = _round_toward(low, float("-inf"))
    scale = _round_toward((high - zero.float()) / levels, float("inf"))
    scale32 = scale.float().unsqueeze(-1)
    safe = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))
    codes = torch.round((xg - zero.float().unsqueeze(-1)) / safe).clamp_(0, levels)
    codes = codes.to(torch.uint8).reshape(*x.shape[:-1], n)
    return QuantizedGroups(pack_codes(codes, bits), scale, zero, bits, group)


def dequantize(q: QuantizedGroups, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reconstruction zero + code * scale, shape [..., n]."""
    codes = unpack_codes(q.packed, q.bits).float()
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // q.group, q.group)
    out = grouped * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
    return out.reshape(codes.shape).to(dtype)


def quantized_bits_per_element(bits: int, group: int) -> float:
    """Storage cost per element: the code plus a float16 scale and zero per group."""
    return bits + 2 * 16 / group
