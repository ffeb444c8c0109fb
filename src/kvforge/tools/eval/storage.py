"""Stored bits per K/V element of an evaluated system: the x axis of the quality/memory
trade-off (README's KIVI Pareto table).

An element is one scalar of K or V (per token: 2 x cache layers x KV heads x head_dim).
- kvforge caches: the cache's own byte accounting per stored token (`kv_bytes_per_token`:
  KIVI codes plus float16 scales and zero points; full: the storage dtype), plus, for KIVI,
  its sink tokens amortised over the evaluated window (kept at the residual's precision on
  top of the pages that also cover them). The full-precision residual (R recent tokens) is
  reported beside it, not in it: its cost per token vanishes as contexts grow.
- transformers' quantised caches (quanto, HQQ): the code bits plus a scale and a zero point
  per group in the model's dtype (how optimum-quanto stores affine groups), with the same
  residual reported beside.
"""

from __future__ import annotations

from typing import Any

import torch

from kvforge.cache.base import CacheMethod


def kvforge_storage(cache: CacheMethod, window: int) -> dict[str, Any]:
    layout = cache.layout
    elements = 2 * sum(spec.num_kv_heads * spec.head_dim for spec in layout.specs)
    bits = cache.memory.kv_bytes_per_token() * 8 / elements
    out: dict[str, Any] = {"quantized_bits_per_element": bits, "stored_bits_per_element": bits}
    config = getattr(cache, "config", None)
    residual_dtype = getattr(cache, "residual_dtype", None)
    if residual_dtype is not None and config is not None:
        residual_bits = torch.tensor([], dtype=residual_dtype).element_size() * 8
        sinks = getattr(config, "sinks", 0)
        out["stored_bits_per_element"] = bits + sinks * residual_bits / window
        out.update(sinks=sinks, residual_tokens=config.residual, residual_bits=residual_bits)
    return out


def hf_quantized_storage(bits: int, group: int, residual: int, model_dtype: torch.dtype) -> dict[str, Any]:
    param_bits = torch.tensor([], dtype=model_dtype).element_size() * 8
    per_element = bits + 2 * param_bits / group
    return {"quantized_bits_per_element": per_element, "stored_bits_per_element": per_element,
            "residual_tokens": residual, "residual_bits": param_bits}
