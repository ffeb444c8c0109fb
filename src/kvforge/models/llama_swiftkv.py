"""SwiftKV Llama (Llama, Mistral, Qwen2): the SwiftKV wiring (models/swiftkv.py) on the
Llama decoder. Later layers are Llama layers whose attention is a `SwiftKVAttention`; in a
decode-only CPU step they run in the fused decode op as the earlier ones do
(models/fused_decode.py), on the K/V the model's fused K/V GEMM stored."""

from __future__ import annotations

import torch
from torch import nn

from kvforge.cache.base import CacheMethod, StepMetadata
from kvforge.models.fused_decode import fused_given_kv
from kvforge.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kvforge.models.swiftkv import SwiftKVAttention, SwiftKVForCausalLM
from kvforge.rope import PositionedRope


class LlamaSwiftKVForCausalLM(SwiftKVForCausalLM, LlamaForCausalLM):
    def make_base_layer(self, layer: int, dtype: torch.dtype, device: torch.device | str,
                        attention: nn.Module) -> nn.Module:
        return LlamaDecoderLayer(self.config, layer, dtype, device, attention)

    def fused_later_layers(self, hidden: torch.Tensor, cache: CacheMethod, meta: StepMetadata,
                           ropes: list[PositionedRope], start: int) -> tuple[torch.Tensor, int]:
        return fused_given_kv(self.model.layers, self.rope_index, hidden, cache, meta, ropes, start,
                              LlamaDecoderLayer, SwiftKVAttention)
