"""One C++ call per Llama-family decoder layer for a decode-only CPU step with the `full` cache.

At batch 1 the per-layer Python of a decode step (module calls, the eligibility checks of
each kernel, the cache's plan lookups, ~20 ops dispatched from Python) costs about as much
as the layer's arithmetic on a small model. `torch.ops.kvforge_cpu_layer.llama_decode_layer`
(cpu_decode_layer.cpp) runs the same ops in the same order from C++, so the result is
bitwise equal to the eager layer (tests/kernels/test_cpu_decode_layer.py); only the Python
goes.

`decode_layer(layer, hidden, cache, rope)` returns None whenever the call is not eligible, and
the layer then runs its eager code, which stays the reference. Eligible: every condition
under which the eager layer would itself take the compiled kernels (CPU, a float dtype shared
by hidden, weights and RoPE tables, at most `MAX_ROWS` rows, no autograd), no step timer
recording (its split needs the separate calls), and a cache that offers the layer's
decode-only plan (`FullCache.fused_decode_target`: every row one decoding sequence, 16/32-bit
pages, the compiled attention kernel). `KVFORGE_DISABLE_CPU_KERNELS=1` or
`KVFORGE_DISABLE_FUSED_LAYER=1` (read at import; tests and A/B benchmarks set
`set_enabled`) turn it off.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvforge.kernels import cpu_fused, cpu_linear
from kvforge.kernels.build import DEFAULT_FLAG_SETS, FLOAT_IO_DTYPES, CppKernel, kernels_disabled
from kvforge.step_timing import current_timer

if TYPE_CHECKING:
    from kvforge.models.rope import PositionedRope

__all__ = ["DISABLE_FUSED_ENV", "decode_layer", "decode_layer_available", "fused_layer_enabled", "set_enabled"]

DISABLE_FUSED_ENV = "KVFORGE_DISABLE_FUSED_LAYER"

_KERNEL = CppKernel(name="kvforge_cpu_decode_layer", source=Path(__file__).with_name("cpu_decode_layer.cpp"),
                    namespace="kvforge_cpu_layer", op="llama_decode_layer", what="fused decoder-layer op",
                    fallback="the layer's eager code", flag_sets=DEFAULT_FLAG_SETS)

_enabled = os.environ.get(DISABLE_FUSED_ENV, "").strip() in ("", "0")
_ready: bool | None = None  # all four libraries loaded (None: not checked yet)


def set_enabled(enabled: bool) -> None:
    """Turn the fused layer on or off for this process (tests, A/B benchmarks)."""
    global _enabled
    _enabled = bool(enabled)


def fused_layer_enabled() -> bool:
    return _enabled and not kernels_disabled()


def decode_layer_available() -> bool:
    """True when the op and every op it calls are built (builds them on the first call)."""
    global _ready
    if _ready is None:
        from kvforge.cache.full.cpu_decode import cpu_kernels_available

        # The op looks the other three up in the dispatcher: their libraries load first.
        _ready = (cpu_linear.small_m_linear_available() and cpu_fused.fused_ops_available()
                  and cpu_kernels_available() and _KERNEL.available())
    return _ready


def decode_layer(layer: Any, hidden: torch.Tensor, cache: Any, rope: PositionedRope) -> torch.Tensor | None:
    """The layer's output for this step through the fused op, or None (run the eager layer).

    `layer` is a LlamaDecoderLayer whose `fusable` is true (plain CachedAttention without
    QK-norm, SiLU gated MLP)."""
    if not _enabled or hidden.dim() != 2 or hidden.shape[0] > cpu_linear.MAX_ROWS or not hidden.is_cpu:
        return None
    dtype = hidden.dtype
    if dtype not in FLOAT_IO_DTYPES or rope.cos.dtype != dtype or not hidden.is_contiguous():
        return None
    if current_timer() is not None or torch.is_grad_enabled() or kernels_disabled():
        return None
    attention, mlp = layer.self_attn, layer.mlp
    target = cache.fused_decode_target(attention.cache_layer)
    if target is None or not decode_layer_available():
        return None
    linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
               mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    weights = [module.weight for module in linears]
    if any(w.dtype != dtype or not w.is_contiguous() for w in weights):
        return None
    biases = [module.bias for module in linears]
    if any(b is not None and b.dtype != dtype for b in biases):
        return None
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    if norm_in.weight.dtype != dtype or norm_post.weight.dtype != dtype:
        return None
    return torch.ops.kvforge_cpu_layer.llama_decode_layer(
        hidden, norm_in.weight, norm_post.weight, float(norm_in.eps), weights, biases, rope.cos, rope.sin,
        *target, attention.num_heads, attention.num_kv_heads, attention.head_dim)
