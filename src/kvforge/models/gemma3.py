"""Gemma3 text decoder.

Differences from Llama: four norms per layer (pre/post attention, pre/post MLP) with
Gemma's (1 + w) scaling; RMSNorm on q and k per head before RoPE; gated GELU-tanh MLP;
embeddings scaled by sqrt(hidden); attention scale query_pre_attn_scalar^-0.5; sliding-
window and global layers as `layer_types` says, each kind with its own RoPE base.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvforge.cache.base import CacheMethod, StepMetadata
from kvforge.config import ModelConfig
from kvforge.models.causal_lm import CausalLM
from kvforge.models.layers import CachedAttention, GatedMLP, GemmaRMSNorm
from kvforge.rope import PositionedRope


class Gemma3DecoderLayer(nn.Module):
    """`attention`: as in LlamaDecoderLayer (a SwiftKV later layer's, given its `later`
    arguments), by default the layer's own CachedAttention, with QK-norm as `config.qk_norm`
    says (the family's config parser sets it)."""

    def __init__(self, config: ModelConfig, cache_layer: int, dtype: torch.dtype,
                 device: torch.device | str, attention: nn.Module | None = None) -> None:
        super().__init__()
        c = config
        norm = lambda: GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)  # noqa: E731
        self.input_layernorm = norm()
        if attention is None:
            attention = CachedAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias,
                                        c.attention_out_bias, cache_layer,
                                        qk_norm_eps=c.rms_norm_eps if c.qk_norm else None, dtype=dtype,
                                        device=device)
        self.self_attn = attention
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, dtype, device)
        self.post_feedforward_layernorm = norm()

    def forward(self, hidden: torch.Tensor, cache: CacheMethod, meta: StepMetadata, rope: PositionedRope,
                *later: Any) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cache, meta, rope, *later)
        # hidden + post_attention_layernorm(attn), then its pre_feedforward_layernorm: one launch on CUDA
        hidden, normed = self.pre_feedforward_layernorm.add_and_norm(hidden, attn, self.post_attention_layernorm)
        return self.post_feedforward_layernorm.add_norm_of(hidden, self.mlp(normed))  # one launch on CUDA


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config, dtype, device)
        # Stored in float32 and cast to the weight dtype at use, as the reference does
        # (in bf16, sqrt(640) = 25.30 rounds to 25.25).
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32, device=device)
        self.register_buffer("embed_scale", scale, persistent=False)

    def make_layer(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        return Gemma3DecoderLayer(self.config, layer, dtype, device)

    def make_norm(self, dim: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        return GemmaRMSNorm(dim, self.config.rms_norm_eps, dtype, device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        embeddings = self.model.embed_tokens(token_ids)
        return embeddings * self.embed_scale.to(embeddings.dtype)
