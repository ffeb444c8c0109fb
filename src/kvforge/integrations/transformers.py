"""KIVI for users who stay in `transformers`: a `Cache` to pass as `cache=` (`past_key_values=`
before transformers 5).

    from kvforge.integrations.transformers import KIVICache
    cache = KIVICache(bits=2, group=32, residual=128, config=model.config)
    model.generate(input_ids, cache=cache, max_new_tokens=64)

The quantisation semantics are those of the engine's `kivi` cache method (KIVI, Liu et
al. 2024), with the arithmetic of `kvforge.cache.kivi.quant` (fp16 zero = min, fp16 scale =
(max - min) / (2^bits - 1), round to nearest, codes bit-packed in bytes):
- keys are quantised per channel over groups of `group` tokens. New keys accumulate in a
  full-precision residual; whenever it holds `residual` tokens or more, the oldest
  multiple of `residual` tokens is quantised and appended. After n tokens the layer holds
  floor(n / R) * R quantised keys and n % R exact ones.
- values are quantised per token over groups of `group` channels. The last `residual`
  tokens stay exact (a sliding window); tokens leaving it are quantised. After n tokens:
  max(0, n - R) quantised values and min(n, R) exact ones.
- the tokens of the current `update` call are returned exactly (a prefill chunk attends
  to its own exact K/V); earlier tokens as stored.

Attention here is transformers' own, which needs dense tensors: `update` dequantises the
stored part and concatenates it with the exact residual on every call. Memory held by the
cache is the packed form, but each step still materialises the whole history in the
compute dtype for the duration of one layer; the engine's `kivi` method avoids that.
Only layers of full attention are supported (Llama family); models with sliding-window
layers are refused, as transformers' own `QuantizedCache` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvforge.cache.kivi.quant import SUPPORTED_BITS, QuantizedGroups, dequantize, quantize
from kvforge.errors import ConfigError, require


@dataclass(frozen=True)
class KIVICacheConfig:
    bits: int = 2
    group: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        require(self.bits in SUPPORTED_BITS, "bits", self.bits, f"must be one of {list(SUPPORTED_BITS)}")
        require(self.group >= 1, "group", self.group, "must be >= 1")
        require(self.residual >= self.group and self.residual % self.group == 0, "residual", self.residual,
                f"must be a positive multiple of group={self.group}")


def _cat_groups(old: QuantizedGroups | None, new: QuantizedGroups, dim: int) -> QuantizedGroups:
    """Append quantised groups along `dim` of packed codes and of scale/zero alike."""
    if old is None:
        return new
    return QuantizedGroups(torch.cat([old.packed, new.packed], dim=dim), torch.cat([old.scale, new.scale], dim=dim),
                           torch.cat([old.zero, new.zero], dim=dim), new.bits, new.group)


def _select(q: QuantizedGroups | None, fn: Any) -> QuantizedGroups | None:
    if q is None:
        return None
    return QuantizedGroups(fn(q.packed), fn(q.scale), fn(q.zero), q.bits, q.group)


class KIVILayer(CacheLayerMixin):
    """One attention layer's KIVI storage. Shapes follow transformers: [batch, heads, tokens, head_dim].

    Stored state (all on the device of the first keys):
      _qkeys:   packed [B, H, D, Tk * bits / 8], scale/zero [B, H, D, Tk / group]  (per channel)
      keys:     exact residual [B, H, n % R, D]
      _qvalues: packed [B, H, Tv, D * bits / 8], scale/zero [B, H, Tv, D / group]  (per token)
      values:   exact window [B, H, min(n, R), D]
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, config: KIVICacheConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.config = config or KIVICacheConfig()
        self._qkeys: QuantizedGroups | None = None
        self._qvalues: QuantizedGroups | None = None
        self.cumulative_length = 0

    # -- sizes -------------------------------------------------------------------------

    @property
    def quantized_key_tokens(self) -> int:
        return 0 if self._qkeys is None else self._qkeys.length

    @property
    def quantized_value_tokens(self) -> int:
        return 0 if self._qvalues is None else int(self._qvalues.packed.shape[-2])

    @property
    def residual_key_tokens(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[-2])

    @property
    def residual_value_tokens(self) -> int:
        return 0 if self.values is None else int(self.values.shape[-2])

    def stored_bytes(self) -> int:
        """Bytes held: packed codes + fp16 scale/zero + the exact residuals."""
        total = sum(q.nbytes() for q in (self._qkeys, self._qvalues) if q is not None)
        for exact in (self.keys, self.values):
            if exact is not None:
                total += exact.numel() * exact.element_size()
        return total

    # -- CacheLayerMixin -----------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        head_dim = int(value_states.shape[-1])
        if head_dim % self.config.group != 0:
            raise ConfigError("group", self.config.group, f"must divide head_dim={head_dim} (values are grouped "
                                                          "along channels)")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[..., :0, :].clone()
        self.values = value_states[..., :0, :].clone()
        self.is_initialized = True

    def dequantized_keys(self) -> torch.Tensor | None:
        """The quantised keys [B, H, Tk, D] in the compute dtype (None before the first flush)."""
        if self._qkeys is None:
            return None
        return dequantize(self._qkeys, self.dtype).transpose(-1, -2)

    def dequantized_values(self) -> torch.Tensor | None:
        if self._qvalues is None:
            return None
        return dequantize(self._qvalues, self.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # What this call attends to: the past as stored, then its own tokens exactly.
        past_keys = [t for t in (self.dequantized_keys(), self.keys) if t is not None]
        past_values = [t for t in (self.dequantized_values(), self.values) if t is not None]
        keys_out = torch.cat([*past_keys, key_states], dim=-2)
        values_out = torch.cat([*past_values, value_states], dim=-2)
        self._store(key_states, value_states)
        self.cumulative_length += int(key_states.shape[-2])
        return keys_out, values_out

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bits, group, residual = self.config.bits, self.config.group, self.config.residual
        keys = torch.cat([self.keys, key_states], dim=-2)
        flush = (keys.shape[-2] // residual) * residual  # whole residual blocks leave the buffer
        if flush:
            block = quantize(keys[..., :flush, :].transpose(-1, -2), bits, group)  # per channel over tokens
            self._qkeys = _cat_groups(self._qkeys, block, dim=-1)
        self.keys = keys[..., flush:, :].contiguous()
        values = torch.cat([self.values, value_states], dim=-2)
        leaving = max(0, values.shape[-2] - residual)  # the oldest tokens leave the exact window
        if leaving:
            block = quantize(values[..., :leaving, :], bits, group)  # per token over channels
            self._qvalues = _cat_groups(self._qvalues, block, dim=-2)
        self.values = values[..., leaving:, :].contiguous()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self._qkeys = self._qvalues = None
        self.is_initialized = False
        self.cumulative_length = 0

    def _map_batch(self, fn: Any) -> None:
        if not self.is_initialized:
            return
        self.keys, self.values = fn(self.keys), fn(self.values)
        self._qkeys, self._qvalues = _select(self._qkeys, fn), _select(self._qvalues, fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("KIVICache cannot crop: quantised tokens cannot be un-stored exactly")


class KIVICache(Cache):
    """KIVI-quantised KV cache for `model.generate(..., cache=KIVICache(...))`.

    Args: bits (2, 4 or 8), group (tokens per key group and channels per value group),
    residual (exact key buffer flushed every `residual` tokens; exact value window of
    `residual` tokens), config (the model's config: one layer per decoder layer, and a
    check that every layer is full attention; without it layers are created on first use).
    """

    def __init__(self, bits: int = 2, group: int = 32, residual: int = 128, config: Any = None) -> None:
        kivi = KIVICacheConfig(bits=bits, group=group, residual=residual)
        self.kivi_config = kivi
        if config is None:
            super().__init__(layer_class_to_replicate=lambda: KIVILayer(kivi))
            return
        text = config.get_text_config(decoder=True)
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        others = sorted(set(layer_types) - {"full_attention"})
        if others or getattr(text, "sliding_window", None) and not getattr(text, "layer_types", None):
            raise ConfigError("model layer types", others or ["sliding_window"],
                              "KIVICache supports only full-attention layers (Llama family)")
        super().__init__(layers=[KIVILayer(kivi) for _ in range(text.num_hidden_layers)])

    def stored_bytes(self) -> int:
        return sum(layer.stored_bytes() for layer in self.layers)


def cache_argument(cache: Any) -> dict[str, Any]:
    """The keyword by which transformers' `generate` and `forward` take a cache: `cache` in
    the versions that deprecate `past_key_values` (they warn on the old name), else
    `past_key_values`."""
    from transformers.generation import utils

    return {"cache": cache} if hasattr(utils, "ALL_CACHE_NAMES") else {"past_key_values": cache}
