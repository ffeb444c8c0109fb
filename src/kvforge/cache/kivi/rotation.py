"""The orthonormal Hadamard rotation of `kivi:rotation=` (QuaRot, llama.cpp and vLLM's
TurboQuant rotate K/V channels before quantising them).

H is the Sylvester Hadamard matrix of order D (a power of two) divided by sqrt(D), so
H H^T = I and rotating costs D^2 multiply-adds per row (D = head_dim: 64 or 256 here).
A rotation spreads a channel whose magnitude stands out over every channel, which narrows
the range of a group that spans channels (values, quantised per token over channel
groups); keys are quantised per channel over tokens, where it mixes channels of different
ranges instead, so whether it helps keys is measured, not assumed (the KIVI table of docs/cache-methods.md).

Where it applies (method.py): rotated keys are stored as k H and queries rotated the same
way, so q H (k H)^T = q k^T: attention scores are unchanged by the rotation itself, only by
the quantisation error in the rotated basis. Rotated values are stored as v H, attention
then returns o H, and o = (o H) H^T undoes it. With key_space=pre_rope the stored pre-RoPE
keys are rotated, and the rotation is undone before RoPE (RoPE mixes channel pairs, which
a rotation of all channels does not commute with).
"""

from __future__ import annotations

import torch

from kvforge.errors import ConfigError


def hadamard_matrix(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal Hadamard matrix [dim, dim] in float32 (dim a power of two)."""
    if dim < 1 or dim & (dim - 1):
        raise ConfigError("rotation", "hadamard", f"needs a head_dim that is a power of two, got head_dim={dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return (h / dim ** 0.5).to(device)


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ matrix, computed in float32, returned in x's dtype."""
    return (x.float() @ matrix).to(x.dtype)


def unrotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ matrix^T (the inverse of `rotate` for an orthonormal matrix)."""
    return (x.float() @ matrix.T).to(x.dtype)
