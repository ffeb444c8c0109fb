"""Analytic work of a step, from the ModelConfig alone (the same numbers for every system).

Conventions:
- a multiply-add is 2 FLOPs; norms, RoPE, activations, softmax and biases are ignored
  (they are small next to the matmuls); the embedding lookup is a gather, not a matmul;
- attention costs 2 matmuls (Q.K^T and P.V) per (query, visible key) pair and query head,
  so 2 * 2 * heads * head_dim FLOPs per pair and layer; a query at position p sees
  min(p + 1, window) keys (itself included; window None = no limit);
- the vocabulary projection runs only for rows that get logits (1 per sequence).

Bytes of a decode step: every weight is read once per step (the batch shares them), except
the embedding table, of which only B rows are gathered; the lm_head matrix is read in full
even when it is tied to the embedding. KV bytes: every model layer reads the stored K/V
of its cache layer for the keys it sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvforge.cache.base import CacheMethod
from kvforge.config import ModelConfig
from kvforge.models.registry import num_parameters


@dataclass(frozen=True)
class PrefillFlops:
    linear: int  # q, k, v, o, gate, up, down projections for every prompt token
    attention: int  # Q.K^T and P.V over the causal (windowed) pairs
    lm_head: int  # vocabulary projection for the rows that get logits

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.lm_head


def _layer_params(config: ModelConfig) -> tuple[int, int]:
    """(q, o, gate, up, down weights; k and v weights) of one decoder layer."""
    h, inter = config.hidden_size, config.intermediate_size
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return 2 * h * q + 3 * h * inter, 2 * h * kv


def linear_params_per_token(config: ModelConfig) -> int:
    """Weights one token multiplies through in the decoder layers (embedding and lm_head
    excluded). For a SwiftKV model: the layers < l and the group leaders' K/V projections
    (what a prompt token that needs no logits runs)."""
    other, kv = _layer_params(config)
    swift = config.swiftkv
    if swift is None:
        return config.num_layers * (other + kv)
    return swift.num_key_value_layers * (other + kv) + len(swift.leaders(config.num_layers)) * kv


def _pairs_from_start(num_tokens: int, window: int | None) -> int:
    """Sum of min(p + 1, window) for p in [0, num_tokens)."""
    if window is None or num_tokens <= window:
        return num_tokens * (num_tokens + 1) // 2
    return window * (window + 1) // 2 + (num_tokens - window) * window


def causal_pairs(num_tokens: int, window: int | None = None, cached: int = 0) -> int:
    """(query, visible key) pairs of `num_tokens` new tokens at positions cached.. (inclusive of self)."""
    return _pairs_from_start(cached + num_tokens, window) - _pairs_from_start(cached, window)


def attention_flops(config: ModelConfig, num_tokens: int, cached: int = 0) -> int:
    """Attention FLOPs of one sequence's step, summed over layers (sliding windows respected).
    SwiftKV later layers attend only for the step's last token (its logit row)."""
    per_pair = 2 * 2 * config.num_heads * config.head_dim
    swift = config.swiftkv
    pairs = 0
    for layer in range(config.num_layers):
        window = config.window_of(layer)
        if swift is not None and swift.is_later(layer):
            pairs += causal_pairs(1, window, cached + num_tokens - 1)
        else:
            pairs += causal_pairs(num_tokens, window, cached)
    return per_pair * pairs


def prefill_flops(config: ModelConfig, prompt_len: int, batch: int = 1) -> PrefillFlops:
    """FLOPs of prefilling `batch` prompts of `prompt_len` tokens, logits for the last token
    of each (SwiftKV: later layers' Q/O and MLP run for that token only)."""
    tokens = prompt_len * batch
    linear = 2 * linear_params_per_token(config) * tokens
    if config.swiftkv is not None:
        later = config.num_layers - config.swiftkv.num_key_value_layers
        linear += 2 * later * _layer_params(config)[0] * batch
    return PrefillFlops(
        linear=linear,
        attention=batch * attention_flops(config, prompt_len),
        lm_head=2 * config.hidden_size * config.vocab_size * batch,
    )


def weight_bytes_per_step(config: ModelConfig, element_size: int) -> int:
    """Weight bytes a decode step reads: all parameters but the embedding table, plus lm_head."""
    table = config.vocab_size * config.hidden_size
    untied_head = 0 if config.tie_word_embeddings else table  # already in num_parameters()
    body = num_parameters(config) - table - untied_head
    return (body + table) * element_size


@dataclass(frozen=True)
class KVReadModel:
    """Per model layer: the sliding window it reads under (None = all keys) and the bytes
    one stored token costs in the cache layer it reads."""

    windows: tuple[int | None, ...]
    bytes_per_token: tuple[float, ...]

    def bytes_read(self, keys_per_sequence: Sequence[int]) -> float:
        """KV bytes one step reads when sequence i attends to keys_per_sequence[i] keys."""
        total = 0.0
        for window, per_token in zip(self.windows, self.bytes_per_token):
            visible = sum(keys if window is None else min(keys, window) for keys in keys_per_sequence)
            total += visible * per_token
        return total

    @classmethod
    def of_cache(cls, cache: CacheMethod) -> KVReadModel:
        """What a kvforge cache method stores (its storage dtype, its layer sharing)."""
        layout = cache.layout
        return cls(tuple(layout.specs[c].sliding_window for c in layout.layer_to_cache),
                   tuple(cache.memory.bytes_per_token(c) for c in layout.layer_to_cache))

    @classmethod
    def of_dense(cls, config: ModelConfig, element_size: int) -> KVReadModel:
        """Plain K and V per layer in the model dtype (transformers' DynamicCache)."""
        per_token = float(2 * config.num_kv_heads * config.head_dim * element_size)
        return cls(tuple(config.window_of(layer) for layer in range(config.num_layers)),
                   (per_token,) * config.num_layers)


def decode_bytes(weight_bytes: int, kv: KVReadModel, batch: int, context: int, steps: int) -> float:
    """Bytes read by `steps` lock-step decode steps of `batch` sequences whose prompts have
    `context` tokens and whose first token came from the prefill: at timed step k each
    sequence attends to context + 1 + k keys (its stored tokens and the new one)."""
    return sum(weight_bytes + kv.bytes_read([context + 1 + k] * batch) for k in range(steps))
