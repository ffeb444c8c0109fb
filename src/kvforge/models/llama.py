"""Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2 (QKV bias), SmolLM2 (tied embeddings).

Pre-norm residual blocks: h += attn(norm(h)); h += mlp(norm(h)). GQA throughout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvforge.cache.base import CacheMethod, StepMetadata
from kvforge.config import ModelConfig
from kvforge.models.causal_lm import CausalLM
from kvforge.models.fused_decode import fused_prefix
from kvforge.models.layers import CachedAttention, GatedMLP, RMSNorm
from kvforge.rope import PositionedRope


class LlamaDecoderLayer(nn.Module):
    """`attention`: a SwiftKV later layer's (models/swiftkv.py), whose forward takes the
    extra arguments `later` that this layer passes on; by default the layer's own
    CachedAttention on cache layer `cache_layer`."""

    def __init__(self, config: ModelConfig, cache_layer: int, dtype: torch.dtype,
                 device: torch.device | str, attention: nn.Module | None = None) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        if attention is None:
            attention = CachedAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias,
                                        c.attention_out_bias, cache_layer, dtype=dtype, device=device)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, dtype, device)

    def forward(self, hidden: torch.Tensor, cache: CacheMethod, meta: StepMetadata, rope: PositionedRope,
                *later: Any) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cache, meta, rope, *later)
        hidden, normed = self.post_attention_layernorm.add_and_norm(hidden, attn)  # one launch on CUDA
        return self.mlp.add_into(hidden, normed)  # the sum is the layer's own: on CUDA, the add is in down's GEMM


class LlamaForCausalLM(CausalLM):
    def make_layer(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        return LlamaDecoderLayer(self.config, layer, dtype, device)

    def make_norm(self, dim: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        return RMSNorm(dim, self.config.rms_norm_eps, dtype, device)

    def run_layers(self, hidden: torch.Tensor, cache: CacheMethod, meta: StepMetadata,
                   ropes: list[PositionedRope], start: int, stop: int) -> torch.Tensor:
        # Decode-only CPU steps: the leading layers in one C++ call when they qualify
        # (bitwise what the eager layers compute; models/fused_decode.py).
        if start == 0:
            hidden, start = fused_prefix(self.model.layers, self.rope_index, hidden, cache, meta, ropes, stop,
                                         LlamaDecoderLayer)
        return super().run_layers(hidden, cache, meta, ropes, start, stop)
