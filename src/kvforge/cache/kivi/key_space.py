"""From stored keys to the keys attention reads (`kivi:key_space=`, `kivi:rotation=`).

With key_space=post_rope (the paper) the stored keys are the attention keys, rotated or not
(a rotation of keys is matched by rotating the queries, method.py): no transform.
With key_space=pre_rope the pages and rings hold pre-RoPE keys (KVQuant's observation:
their outlier channels are fixed, where RoPE makes a channel pair oscillate with the
position, which widens a per-channel group's range). Readers then apply `StoredKeys`:
undo the rotation if the keys were rotated, then RoPE at each stored token's position,
after dequantisation and in float32, so a key is quantised once and rotated exactly.
The compiled CPU kernel does the same in registers from `rope_tables` (cos/sin per channel
pair and position, the values `RotaryEmbedding.cos_sin` gives, so both paths rotate alike).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kvforge.rope import RotaryEmbedding, rotate_half


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

    def rope_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin float32 [D/2, T] (channel pair-major; T >= positions) of this layer's RoPE
        for positions [0, T): what the compiled kernel reads. Cached per rotary module and
        grown in steps of `TABLE_STEP` positions, so a decode step computes none."""
        cached = _TABLES.get(self.rotary)
        if cached is None or cached[0].shape[1] < positions:
            length = -(-max(positions, 1) // TABLE_STEP) * TABLE_STEP
            at = torch.arange(length, device=self.rotary.inv_freq.device)
            cos, sin = self.rotary.cos_sin(at, torch.float32)
            half = cos.shape[-1] // 2
            cached = (cos[:, :half].T.contiguous(), sin[:, :half].T.contiguous())
            _TABLES[self.rotary] = cached
        return cached


# Positions added to the cached tables at a time (4096 x 32 pairs x 2 tables: 1 MB at D = 64).
TABLE_STEP = 4096
_TABLES: weakref.WeakKeyDictionary[RotaryEmbedding, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()


KeyTransform = StoredKeys | None
