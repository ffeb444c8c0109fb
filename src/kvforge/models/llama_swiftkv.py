"""SwiftKV Llama (Llama, Mistral, Qwen2): the SwiftKV wiring (models/swiftkv.py) on the
Llama decoder. Later layers are Llama layers whose attention is a `SwiftKVAttention`."""

from __future__ import annotations

import torch
from torch import nn

from kvforge.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kvforge.models.swiftkv import SwiftKVForCausalLM


class LlamaSwiftKVForCausalLM(SwiftKVForCausalLM, LlamaForCausalLM):
    def make_base_layer(self, layer: int, dtype: torch.dtype, device: torch.device | str,
                        attention: nn.Module) -> nn.Module:
        return LlamaDecoderLayer(self.config, layer, dtype, device, attention)
