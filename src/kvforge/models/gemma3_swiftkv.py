"""SwiftKV Gemma3: the SwiftKV wiring (models/swiftkv.py) on the Gemma3 decoder.

What Gemma3 adds: `norm_swiftkv` is a Gemma (1 + w) RMSNorm (the architecture's norm);
later layers keep their four norms and their `q_norm`, a group leader its `k_norm` (applied
to the group's keys); embeddings are scaled and logits soft-capped as in the base model.
Sliding-window and global later layers each keep their own window and RoPE base, so an
AcrossKV group never mixes the two (refused in `ModelConfig`)."""

from __future__ import annotations

import torch
from torch import nn

from kvforge.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM
from kvforge.models.swiftkv import SwiftKVForCausalLM


class Gemma3SwiftKVForCausalLM(SwiftKVForCausalLM, Gemma3ForCausalLM):
    def make_base_layer(self, layer: int, dtype: torch.dtype, device: torch.device | str,
                        attention: nn.Module) -> nn.Module:
        return Gemma3DecoderLayer(self.config, layer, dtype, device, attention)
