"""Rotary position embeddings (rotate-half convention, as in Hugging Face checkpoints).

GGUF Llama checkpoints store Q/K rows permuted for the interleaved convention; the loader
undoes that so every model here uses rotate-half.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvforge.config import RopeConfig
from kvforge.kernels import cuda_fused
from kvforge.kernels.cpu_fused import rope_rotate


def rope_inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim / 2] in float32, with the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, the band
    between them interpolated smoothly in 1/wavelength."""
    original = rope.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    long_limit = original / rope.low_freq_factor  # wavelengths above this are slowed fully
    short_limit = original / rope.high_freq_factor  # wavelengths below this are untouched
    slowed = inv_freq / rope.factor
    blend = (original / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - blend) * slowed + blend * inv_freq
    scaled = torch.where(wavelength > long_limit, slowed, inv_freq)
    in_band = (wavelength <= long_limit) & (wavelength >= short_limit)
    return torch.where(in_band, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Frequencies of one attention kind; `at(positions)` gives tables for a step.

    `inv_freq` is a non-persistent buffer: it follows `.to()` / `.cuda()` of the model (so
    the tables are built on the device of the step's positions) and adds no state-dict key
    (checkpoints name no RoPE tensor). It stays float32 whatever the model's dtype: the
    angles are computed in float32, and bfloat16 frequencies would shift distant positions.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.head_dim = head_dim
        self.config = rope
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, rope).to(device), persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            # A cast (model.to(torch.bfloat16)) rounded them: rebuild exactly, on the new device.
            self.inv_freq = rope_inverse_frequencies(self.head_dim, self.config).to(self.inv_freq.device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [N, head_dim] for integer positions, computed in float32."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> PositionedRope:
        cos, sin = self.cos_sin(positions, dtype)
        return PositionedRope(cos=cos, sin=sin, rotary=self)


@dataclass(frozen=True)
class PositionedRope:
    """RoPE tables for the rows of one step. Cache methods that keep pre-RoPE keys use
    `rotary` to rotate keys at other positions (e.g. on reconstruction)."""

    cos: torch.Tensor  # [T, head_dim]
    sin: torch.Tensor  # [T, head_dim]
    rotary: RotaryEmbedding

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] whose rows match this step's rows (one fused op on
        CPU or one Triton launch on CUDA when eligible: kernels/cpu_fused.py, cuda_fused.py)."""
        fused = rope_rotate(x, self.cos, self.sin)
        if fused is None:
            fused = cuda_fused.rope_rotate(x, self.cos, self.sin)
        if fused is not None:
            return fused
        cos = self.cos[:, None, :]
        sin = self.sin[:, None, :]
        return x * cos + rotate_half(x) * sin

    def apply_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [N, heads, head_dim] at arbitrary positions [N]."""
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
