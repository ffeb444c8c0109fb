"""The Llama family's fused decode path: the longest run of leading layers that one C++ op
call computes (kernels/cpu_decode_layer.py), bitwise what the eager layers compute.

`fused_prefix(layers, rope_index, hidden, cache, meta, ropes, stop, layer_class)` returns
(hidden after the run, its length); 0 means none qualifies and the model runs every layer
eagerly (the reference). A layer qualifies when it is exactly a `layer_class` (the family's
`LlamaDecoderLayer`) of the plain classes
(CachedAttention without QK-norm, a SiLU GatedMLP, RMSNorms of one eps, nn.Linear
projections; no forward hooks: `_layer_shape`) and its cache layer offers a target
(`CacheMethod.fused_decode_target`) that joins the run's first one, with the first layer's
geometry and RoPE table. The step qualifies under the conditions in which the eager layers
would themselves take the compiled kernels (CPU, one float dtype for hidden, weights and
RoPE tables, at most `cpu_linear.MAX_ROWS` rows, no autograd) and with no step timer
recording (its split of the step needs the separate calls).

`fused_given_kv(..., start, layer_class, attention_class)` does the same for a SwiftKV
model's later layers `layers[start:]` (attention exactly `attention_class`, SwiftKVAttention
without QK-norm), whose K/V the model's fused K/V GEMM stored before they run: the op's
second entry skips their K/V projection and store, and each attends with the step's K/V of
its (AcrossKV: its group's) cache layer, which its target must hold (`given_kv`). It needs
every row of the step among the logit rows, in order, as a decode-only step has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from kvforge.cache.base import CacheMethod, FusedDecodeTarget, StepMetadata
from kvforge.kernels import cpu_decode_layer, cpu_linear
from kvforge.kernels.build import FLOAT_IO_DTYPES
from kvforge.kernels.cpu_decode_layer import DecodeLayerRun
from kvforge.models.layers import CachedAttention, GatedMLP, RMSNorm
from kvforge.rope import PositionedRope
from kvforge.step_timing import current_timer

LayerShape = tuple[float, int, int, int, int]  # (eps, heads, kv heads, head dim, cache layer)


def fused_prefix(layers: nn.ModuleList, rope_index: Sequence[int], hidden: torch.Tensor, cache: CacheMethod,
                 meta: StepMetadata, ropes: Sequence[PositionedRope], stop: int,
                 layer_class: type[nn.Module]) -> tuple[torch.Tensor, int]:
    """(hidden after the fused run of `layers[:stop]`, its length); (hidden, 0) when none qualifies."""
    if stop <= 0:
        return hidden, 0
    return _fused_run(layers, rope_index, hidden, cache, meta, ropes, 0, stop, layer_class, CachedAttention, False)


def fused_given_kv(layers: nn.ModuleList, rope_index: Sequence[int], hidden: torch.Tensor, cache: CacheMethod,
                   meta: StepMetadata, ropes: Sequence[PositionedRope], start: int, layer_class: type[nn.Module],
                   attention_class: type[nn.Module]) -> tuple[torch.Tensor, int]:
    """(hidden after the fused run of `layers[start:]`, its length) for SwiftKV's later layers
    (`attention_class`: SwiftKVAttention), whose K/V the model's fused K/V GEMM stored before
    they run: the op projects no K/V and stores none, and each layer attends with its cache
    layer's `given_kv`. `hidden` and `ropes` must cover every row of the step, in order (the
    step's logit rows are all its rows: a decode-only step in which every sequence samples),
    which is what `attend_rows` then attends for; else (hidden, 0)."""
    batch = meta.batch
    if start >= len(layers) or batch.logit_row_list != tuple(range(batch.num_tokens)):
        return hidden, 0
    return _fused_run(layers, rope_index, hidden, cache, meta, ropes, start, len(layers), layer_class,
                      attention_class, True)


def _fused_run(layers: nn.ModuleList, rope_index: Sequence[int], hidden: torch.Tensor, cache: CacheMethod,
               meta: StepMetadata, ropes: Sequence[PositionedRope], start: int, stop: int,
               layer_class: type[nn.Module], attention_class: type[nn.Module],
               given_kv: bool) -> tuple[torch.Tensor, int]:
    """The longest qualifying run of `layers[start:stop]` through the op; (hidden, 0) when the
    first layer does not qualify. `given_kv`: the layers' K/V are already stored (a target
    without `given_kv` ends the run: its cache layer was not written this step)."""
    if not _step_qualifies(hidden) or not cpu_decode_layer.enabled():
        return hidden, 0
    modules = list(layers._modules.values())
    shape = _layer_shape(modules[start], layer_class, attention_class)
    if shape is None:
        return hidden, 0
    rope = ropes[rope_index[start]]
    if not _rope_qualifies(rope, hidden.dtype, shape[3]):
        return hidden, 0
    first = cache.fused_decode_target(shape[4], meta)
    if first is None or (given_kv and first.given_kv() is None):
        return hidden, 0
    targets: list[FusedDecodeTarget] = []
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    for index in range(start, stop):
        layer = modules[index]
        target = first
        if index > start:
            layer_shape = _layer_shape(layer, layer_class, attention_class)
            # every layer of the run: the first one's eps and geometry, RoPE table and plan
            if layer_shape is None or layer_shape[:4] != shape[:4] or ropes[rope_index[index]] is not rope:
                break
            target = cache.fused_decode_target(layer_shape[4], meta)
            if target is None or not target.joins(first) or (given_kv and target.given_kv() is None):
                break
        layer_weights, layer_biases = _parameters_of(layer, given_kv)
        if not _kernel_ready(layer_weights, layer_biases, hidden.dtype):
            break
        targets.append(target)
        weights += layer_weights
        biases += layer_biases
    if not targets:
        return hidden, 0
    eps, num_heads, num_kv_heads, head_dim = shape[:4]
    run = DecodeLayerRun(weights, biases, eps, rope.cos, rope.sin, num_heads, num_kv_heads, head_dim)
    if given_kv:
        return type(first).run_layers_given_kv(targets, hidden, run), len(targets)
    return type(first).run_layers(targets, hidden, run), len(targets)


def _step_qualifies(hidden: torch.Tensor) -> bool:
    if hidden.dim() != 2 or hidden.shape[0] > cpu_linear.MAX_ROWS or not hidden.is_cpu:
        return False
    if hidden.dtype not in FLOAT_IO_DTYPES or not hidden.is_contiguous():
        return False
    # Global module hooks are skipped by the op (it calls no module): then run eagerly.
    hooks = nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
    return current_timer() is None and not torch.is_grad_enabled() and not hooks


def _rope_qualifies(rope: PositionedRope, dtype: torch.dtype, head_dim: int) -> bool:
    cos, sin = rope.cos, rope.sin
    return (cos.dtype == dtype and cos.dim() == 2 and cos.shape[1] == head_dim and head_dim % 2 == 0
            and cos.is_contiguous() and sin.is_contiguous())


_PLAIN = frozenset((GatedMLP, RMSNorm, nn.Linear))


def _layer_shape(layer: Any, layer_class: type[nn.Module], attention_class: type[nn.Module]) -> LayerShape | None:
    """(eps, heads, kv heads, head dim, cache layer) of a layer the op computes exactly, or
    None. Checked every step, not once at construction: a replaced submodule (another norm,
    a QK-norm, a non-Linear projection) or a hook on one makes the layer run eagerly."""
    modules = layer._modules
    attention, mlp = modules.get("self_attn"), modules.get("mlp")
    norm_in, norm_post = modules.get("input_layernorm"), modules.get("post_attention_layernorm")
    if (type(layer) is not layer_class or type(attention) is not attention_class
            or type(mlp) is not GatedMLP or type(norm_in) is not RMSNorm or type(norm_post) is not RMSNorm
            or attention.q_norm is not None or norm_in.eps != norm_post.eps or mlp.activation is not F.silu):
        return None
    for module in (layer, attention):
        if module._forward_hooks or module._forward_pre_hooks:
            return None
    for module in (mlp, norm_in, norm_post, *attention._modules.values(), *mlp._modules.values()):
        if module._forward_hooks or module._forward_pre_hooks or type(module) not in _PLAIN:
            return None
    return float(norm_in.eps), attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.cache_layer


def _parameters_of(layer: Any, given_kv: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The op's weights (input norm, post norm, q, k, v, o, gate, up, down) and biases (q, k,
    v, o, gate, up, down) of a layer; with `given_kv` (a SwiftKV later layer) q is
    `q_proj_swiftkv` and there is no k or v. Read from the modules' own dicts: nn.Module
    attribute access costs a lookup each, and a step makes ~25 per layer. Read afresh every
    step, so replaced or cast parameters are always seen."""
    modules = layer._modules
    attention, mlp = modules["self_attn"]._modules, modules["mlp"]._modules
    projections = ((attention["q_proj_swiftkv"],) if given_kv
                   else (attention["q_proj"], attention["k_proj"], attention["v_proj"]))
    linears = (*projections, attention["o_proj"], mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"])
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
