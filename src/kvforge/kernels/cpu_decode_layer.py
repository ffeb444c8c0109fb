"""One C++ call for the Llama-family decoder layers of a decode-only CPU step with the `full` or `kivi` cache.

At batch 1 the per-layer Python of a decode step (module calls, the eligibility checks of
each kernel, the cache's plan lookups, ~20 ops dispatched from Python) costs about as much
as the layers' arithmetic on a small model. `torch.ops.kvforge_cpu_layer.llama_decode_layers`
(cpu_decode_layer.cpp) runs the same ops in the same order from C++ for a run of layers, so
the result is bitwise equal to the eager layers (tests/kernels/test_cpu_decode_layer.py);
only the Python goes.

`decode_layers(layers, rope_index, hidden, cache, ropes)` runs the longest prefix of `layers`
that qualifies and returns (hidden, how many layers it ran); 0 means none, and the model
runs every layer eagerly (the reference). A layer qualifies when it is exactly a
LlamaDecoderLayer of the plain classes (CachedAttention without QK-norm, a SiLU GatedMLP,
RMSNorms of one eps, nn.Linear projections; no forward hooks: `_layer_shape`) and the cache offers its
decode-only plan (`FullCache.fused_decode_target`: every row one decoding sequence, 16/32-bit
pages, the compiled attention kernel; or `KIVICache.fused_decode_target`, a
`KiviLayerTarget`: post-RoPE keys, no rotation, the C++ decode kernel, rows in order), with
the plan and RoPE of the prefix's first layer (one cache layer group). The step qualifies under the conditions in which the eager layers
would themselves take the compiled kernels (CPU, one float dtype for hidden, weights and
RoPE tables, at most `MAX_ROWS` rows, no autograd) and with no step timer recording (its
split needs the separate calls). `KVFORGE_DISABLE_CPU_KERNELS=1` or
`KVFORGE_DISABLE_FUSED_LAYER=1` (read at import; tests and A/B benchmarks call
`set_enabled`) turn it off.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.kernels import cpu_fused, cpu_linear
from kvforge.kernels.build import DEFAULT_FLAG_SETS, FLOAT_IO_DTYPES, CppKernel, kernels_disabled
from kvforge.step_timing import current_timer

if TYPE_CHECKING:
    from kvforge.rope import PositionedRope

__all__ = ["DISABLE_FUSED_ENV", "KiviLayerTarget", "decode_layer_available", "decode_layers", "set_enabled"]

DISABLE_FUSED_ENV = "KVFORGE_DISABLE_FUSED_LAYER"

_KERNEL = CppKernel(name="kvforge_cpu_decode_layer", source=Path(__file__).with_name("cpu_decode_layer.cpp"),
                    namespace="kvforge_cpu_layer", op="llama_decode_layers", what="fused decoder-layer op",
                    fallback="the layer's eager code", flag_sets=DEFAULT_FLAG_SETS)

_enabled = os.environ.get(DISABLE_FUSED_ENV, "").strip() in ("", "0")


class KiviLayerTarget(NamedTuple):
    """What `KIVICache.fused_decode_target` hands the op for one cache layer: its storage
    (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res), its sinks (or None),
    the group's decode plan (page_table, first_page_position, visible_from, lengths, slots:
    the same tensor objects for every layer of the group) and the kernel's settings (scale,
    bits, value_bits, key_dot, value_dot codes). After the op the cache receives each layer's
    k and v through `fused_decode_written`, as its `write` would have kept them."""

    cache_layer: int
    storage: tuple[torch.Tensor, ...]
    sinks: tuple[torch.Tensor | None, torch.Tensor | None]
    plan: tuple[torch.Tensor, ...]
    settings: tuple[float, int, int, int, int]
_ready: bool | None = None  # all four libraries loaded (None: not checked yet)


def set_enabled(enabled: bool) -> None:
    """Turn the fused layer on or off for this process (tests, A/B benchmarks)."""
    global _enabled
    _enabled = bool(enabled)


def decode_layer_available() -> bool:
    """True when the op and every op it calls are built (builds them on the first call).
    The answer is kept once known, except while kernels are disabled (that is read on every
    call, as CppKernel.available does)."""
    global _ready
    if kernels_disabled():
        return False
    if _ready is None:
        from kvforge.cache.full.cpu_decode import cpu_kernels_available

        # The op looks the other three up in the dispatcher: their libraries load first.
        _ready = (cpu_linear.small_m_linear_available() and cpu_fused.fused_ops_available()
                  and cpu_kernels_available() and _KERNEL.available())
    return _ready


def decode_layers(layers: Sequence[Any], rope_index: Sequence[int], hidden: torch.Tensor, cache: Any,
                  ropes: Sequence[PositionedRope], stop: int | None = None) -> tuple[torch.Tensor, int]:
    """(hidden after the fused prefix of `layers[:stop]`, its length); (hidden, 0) when none
    qualifies."""
    stop = len(layers) if stop is None else stop
    if not _enabled or hidden.dim() != 2 or hidden.shape[0] > cpu_linear.MAX_ROWS or not hidden.is_cpu:
        return hidden, 0
    dtype = hidden.dtype
    if dtype not in FLOAT_IO_DTYPES or not hidden.is_contiguous():
        return hidden, 0
    if current_timer() is not None or torch.is_grad_enabled() or kernels_disabled() or _global_hooks():
        return hidden, 0
    # Looked up on the class: a wrapper that forwards attributes (__getattr__) to a cache it
    # wraps must not hand out the wrapped cache's target; it gets the eager layers.
    target_of = getattr(type(cache), "fused_decode_target", None)
    modules = list(layers._modules.values()) if hasattr(layers, "_modules") else list(layers)
    first = modules[0] if stop > 0 else None
    if target_of is None or first is None or not decode_layer_available():
        return hidden, 0
    shape = _layer_shape(first)
    if shape is None:
        return hidden, 0
    rope = ropes[rope_index[0]]
    head_dim = shape[3]
    if (rope.cos.dtype != dtype or rope.cos.dim() != 2 or rope.cos.shape[1] != head_dim or head_dim % 2
            or not rope.cos.is_contiguous() or not rope.sin.is_contiguous()):
        return hidden, 0
    target = target_of(cache, shape[4])
    if target is None:
        return hidden, 0
    if isinstance(target, KiviLayerTarget):
        return _kivi_layers(modules[:stop], rope_index, ropes, hidden, cache, shape, target)
    plan = target[2:]  # write slots, page table, positions, scale: one group's
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    k_pages: list[torch.Tensor] = []
    v_pages: list[torch.Tensor] = []
    for index in range(stop):
        layer = modules[index]
        if index:
            layer_shape = _layer_shape(layer)
            # every layer of the run: the first one's eps and geometry, RoPE tables and plan
            if layer_shape is None or layer_shape[:4] != shape[:4] or ropes[rope_index[index]] is not rope:
                break
            target = target_of(cache, layer_shape[4])
            # the same group's plan tensors (identity) and the same softmax scale (value)
            if target is None or any(a is not b for a, b in zip(target[2:-1], plan[:-1])) or target[-1] != plan[-1]:
                break
        layer_weights, layer_biases = _parameters_of(layer)
        if not _kernel_ready(layer_weights, layer_biases, dtype):
            break
        weights += layer_weights
        biases += layer_biases
        k_pages.append(target[0])
        v_pages.append(target[1])
    if not k_pages:
        return hidden, 0
    eps, num_heads, num_kv_heads, head_dim = shape[:4]
    out = torch.ops.kvforge_cpu_layer.llama_decode_layers(
        hidden, weights, biases, eps, rope.cos, rope.sin, k_pages, v_pages, *plan, num_heads, num_kv_heads, head_dim)
    return out, len(k_pages)


def _kivi_layers(modules: Sequence[Any], rope_index: Sequence[int], ropes: Sequence[PositionedRope],
                 hidden: torch.Tensor, cache: Any, shape: tuple[float, int, int, int, int],
                 first: KiviLayerTarget) -> tuple[torch.Tensor, int]:
    """`decode_layers` over a `kivi` cache: the longest prefix whose layers share the first
    one's geometry, RoPE, decode plan and kernel settings; every row one decoding sequence."""
    if hidden.shape[0] != first.plan[3].shape[0]:  # lengths: one per decoding row, in order
        return hidden, 0
    rope = ropes[rope_index[0]]
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    storage: list[torch.Tensor] = []
    sinks: list[torch.Tensor | None] = []
    cache_layers: list[int] = []
    target_of = type(cache).fused_decode_target
    for index, layer in enumerate(modules):
        target = first
        if index:
            layer_shape = _layer_shape(layer)
            if layer_shape is None or layer_shape[:4] != shape[:4] or ropes[rope_index[index]] is not rope:
                break
            target = target_of(cache, layer_shape[4])
            if (not isinstance(target, KiviLayerTarget) or target.settings != first.settings
                    or any(a is not b for a, b in zip(target.plan, first.plan))):
                break
        layer_weights, layer_biases = _parameters_of(layer)
        if not _kernel_ready(layer_weights, layer_biases, hidden.dtype):
            break
        weights += layer_weights
        biases += layer_biases
        storage += target.storage
        sinks += target.sinks
        cache_layers.append(target.cache_layer)
    if not cache_layers:
        return hidden, 0
    eps, num_heads, num_kv_heads, head_dim = shape[:4]
    out, keys, values = torch.ops.kvforge_cpu_layer.llama_decode_layers_kivi(
        hidden, weights, biases, eps, rope.cos, rope.sin, storage, sinks, *first.plan, *first.settings,
        num_heads, num_kv_heads, head_dim)
    for cache_layer, k, v in zip(cache_layers, keys, values):
        cache.fused_decode_written(cache_layer, k, v)
    return out, len(cache_layers)


def _global_hooks() -> bool:
    """Global module hooks are skipped by the op (it calls no module): then run eagerly."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


_plain: dict[str, Any] = {}  # the module classes the op reproduces (imported at first use: no cycle)


def _plain_classes() -> dict[str, Any]:
    if not _plain:
        from kvforge.models.layers import CachedAttention, GatedMLP, RMSNorm
        from kvforge.models.llama import LlamaDecoderLayer

        _plain.update(layer=LlamaDecoderLayer, attention=CachedAttention, mlp=GatedMLP, norm=RMSNorm,
                      all=frozenset((LlamaDecoderLayer, CachedAttention, GatedMLP, RMSNorm, nn.Linear)))
    return _plain


def _layer_shape(layer: Any) -> tuple[float, int, int, int, int] | None:
    """(eps, heads, kv heads, head dim, cache layer) of a layer the op computes exactly, or
    None. Checked every step, not once at construction: a replaced submodule (another norm,
    a QK-norm, a non-Linear projection) or a hook on one makes the layer run eagerly."""
    plain = _plain_classes()
    modules = layer._modules
    attention, mlp = modules.get("self_attn"), modules.get("mlp")
    norm_in, norm_post = modules.get("input_layernorm"), modules.get("post_attention_layernorm")
    if (type(layer) is not plain["layer"] or type(attention) is not plain["attention"]
            or type(mlp) is not plain["mlp"] or type(norm_in) is not plain["norm"] or type(norm_post) is not plain["norm"]
            or attention.q_norm is not None or norm_in.eps != norm_post.eps or mlp.activation is not F.silu):
        return None
    for module in (layer, attention, mlp, norm_in, norm_post, *attention._modules.values(), *mlp._modules.values()):
        if module._forward_hooks or module._forward_pre_hooks or type(module) not in plain["all"]:
            return None
    return float(norm_in.eps), attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.cache_layer


def _parameters_of(layer: Any) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The op's 9 weights (input norm, post norm, q, k, v, o, gate, up, down) and 7 biases of a
    layer, read from the modules' own dicts: nn.Module attribute access costs ~0.3 us a
    lookup, and a step makes ~25 per layer (about 0.8 ms a step on a 30-layer model).
    Read afresh every step, so replaced or cast parameters are always seen."""
    modules = layer._modules
    attention, mlp = modules["self_attn"]._modules, modules["mlp"]._modules
    linears = (attention["q_proj"], attention["k_proj"], attention["v_proj"], attention["o_proj"],
               mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"])
    params = [module._parameters for module in linears]
    weights = [modules["input_layernorm"]._parameters["weight"], modules["post_attention_layernorm"]._parameters["weight"],
               *(p["weight"] for p in params)]
    return weights, [p.get("bias") for p in params]


def _kernel_ready(weights: list[torch.Tensor], biases: list[torch.Tensor | None], dtype: torch.dtype) -> bool:
    """What the kernels require of a layer's parameters (else the eager layer runs, which
    falls back or adapts where the op would raise)."""
    for w in weights:
        if w.dtype != dtype or not w.is_contiguous() or not w.is_cpu:
            return False
    for b in biases:
        if b is not None and (b.dtype != dtype or not b.is_contiguous() or not b.is_cpu or b.dim() != 1):
            return False
    return True
