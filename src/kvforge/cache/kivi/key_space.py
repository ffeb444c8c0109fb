"""From stored keys to the keys attention reads (`kivi:key_space=`, `kivi:rotation=`).

With key_space=post_rope (the paper) the stored keys are the attention keys, rotated or not
(a rotation of keys is matched by rotating the queries, method.py): no transform.
With key_space=pre_rope the pages and rings hold pre-RoPE keys (KVQuant's observation:
their outlier channels are fixed, where RoPE makes a channel pair oscillate with the
position, which widens a per-channel group's range). Readers then apply `StoredKeys`:
undo the rotation if the keys were rotated, then RoPE at each stored token's position,
after dequantisation and in float32, so a key is quantised once and rotated exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.models.rope import RotaryEmbedding, rotate_half


@dataclass(frozen=True)
class StoredKeys:
    """Pre-RoPE stored keys -> attention keys. `rotation`: the matrix the keys were stored
    rotated by (None: not rotated); `rotary`: the layer's RoPE."""

    rotary: RotaryEmbedding
    rotation: torch.Tensor | None = None

    def __call__(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """keys [..., m, D] (float32) of tokens at `positions` [..., m] (broadcast from the
        right against keys' leading dimensions but the last) -> RoPE'd keys, float32."""
        if self.rotation is not None:
            keys = keys @ self.rotation.T
        cos, sin = self.rotary.cos_sin(positions.reshape(-1), torch.float32)
        shape = (*positions.shape, keys.shape[-1])
        return keys * cos.view(shape) + rotate_half(keys) * sin.view(shape)


KeyTransform = StoredKeys | None
