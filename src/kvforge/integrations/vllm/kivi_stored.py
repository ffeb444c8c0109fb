"""What the vLLM KIVI backend stores of the keys and values vLLM's model hands it, and what
its readers attend with (pure kvforge: no vLLM import). It mirrors `KIVICache.write` and
`attend` (cache/kivi/method.py) for the options `kivi:key_space=` and `kivi:rotation=`.

vLLM's attention layer receives keys after RoPE. kvforge's KIVI with key_space=pre_rope
stores keys before it, so `stored_keys` undoes RoPE at each token's position (RoPE is a
rotation of each channel pair by the angle of the position: its inverse is the rotation by
minus that angle), in float32 with the layer's RoPE built from the model's HF config
through kvforge's own `RotaryEmbedding`, then rounds to the keys' dtype, as kvforge's model
hands its cache pre-RoPE keys in the compute dtype. The recovered keys differ from the
model's own pre-RoPE keys only by the rounding of the post-RoPE keys and of the float32
round trip (docs/swiftkv.md, "KIVI in vLLM", gives the measured size). Readers RoPE the
stored keys after dequantisation (`key_transform`, key_space.StoredKeys), as kvforge's do.

Rotations (rotation.py): values are stored as v H and attention's output o H is undone by
H^T (`output`); rotated post-RoPE keys are matched by rotating the queries (`queries`);
rotated pre-RoPE keys are unrotated by the readers before RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvforge.cache.kivi.config import KIVICacheConfig
from kvforge.cache.kivi.key_space import KeyTransform, StoredKeys
from kvforge.cache.kivi.rotation import hadamard_matrix, rotate, unrotate
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.rope import RotaryEmbedding, rotate_half


def unrope(keys: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
    """Post-RoPE keys [T, H, D] of tokens at `positions` [T] -> pre-RoPE keys, float32:
    k = y cos - rotate_half(y) sin, the inverse of y = k cos + rotate_half(k) sin."""
    cos, sin = rotary.cos_sin(positions, torch.float32)
    post = keys.float()
    return post * cos[:, None, :] - rotate_half(post) * sin[:, None, :]


def rotary_of_model(hf_config: dict[str, Any], head_dim: int, device: torch.device) -> RotaryEmbedding:
    """The RoPE of the model's global-attention layers (the backend refuses sliding windows,
    the only layers a second RoPE configuration applies to), from its HF config dict."""
    return RotaryEmbedding(head_dim, config_from_hf_dict(hf_config).rope, device)


@dataclass(frozen=True)
class StoredForm:
    """`rotary`: the layer's RoPE (key_space=pre_rope only); `rotation`: the Hadamard matrix
    (any rotation only)."""

    config: KIVICacheConfig
    rotary: RotaryEmbedding | None = None
    rotation: torch.Tensor | None = None

    @classmethod
    def of(cls, config: KIVICacheConfig, hf_config: dict[str, Any] | None, head_dim: int,
           device: torch.device) -> StoredForm:
        rotary = None
        if config.key_space == "pre_rope":
            if hf_config is None:
                raise ValueError("key_space=pre_rope needs the model's HF config (its RoPE)")
            rotary = rotary_of_model(hf_config, head_dim, device)
        rotation = hadamard_matrix(head_dim, device) if config.rotation != "none" else None
        return cls(config, rotary, rotation)

    def _rotated(self, x: torch.Tensor, when: bool) -> torch.Tensor:
        return rotate(x, self.rotation) if when and self.rotation is not None else x

    def stored_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What pages, copies and sinks hold of vLLM's keys [T, H, D] at `positions` [T]."""
        if self.rotary is not None:
            keys = unrope(keys, positions, self.rotary).to(keys.dtype)
        return self._rotated(keys, self.config.rotates_keys)

    def values(self, values: torch.Tensor) -> torch.Tensor:
        """What is stored and attended of vLLM's values [T, H, D]."""
        return self._rotated(values, self.config.rotates_values)

    def attention_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The step's own keys as attention reads them: post-RoPE, rotated with the queries
        when post-RoPE keys are stored rotated."""
        return self._rotated(keys, self.config.rotates_keys and self.rotary is None)

    def queries(self, queries: torch.Tensor) -> torch.Tensor:
        """q H . k H = q . k for rotated post-RoPE keys; queries as they are otherwise."""
        return self.attention_keys(queries)

    def key_transform(self) -> KeyTransform:
        """Stored keys -> attention keys for the readers (None: stored as attention reads them)."""
        if self.rotary is None:
            return None
        return StoredKeys(self.rotary, self.rotation if self.config.rotates_keys else None)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output over rotated values, o H, back to o."""
        if self.config.rotates_values and self.rotation is not None:
            return unrotate(out, self.rotation)
        return out
