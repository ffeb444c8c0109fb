"""One C++ call for a run of Llama-family decoder layers in a decode-only CPU step.

At batch 1 the per-layer Python of a decode step (module calls, the eligibility checks of
each kernel, the cache's plan lookups, ~20 ops dispatched from Python) costs about as much
as the layers' arithmetic on a small model. The ops of cpu_decode_layer.cpp run the same
ops in the same order from C++ for a run of layers (RMSNorm, q/k/v projections, RoPE, the
cache's decode attention, o_proj, the gated SiLU MLP), so their result is bitwise equal to
the eager layers (tests/kernels/test_cpu_decode_layer.py); only the Python goes.

This module is a leaf: it takes tensors and plain parameters. Which layers qualify is the
model's decision (models/fused_decode.py), what a cache layer hands the op is the cache
method's (its `FusedDecodeTarget`); the attention kernel a target names must be loaded
before its op runs (the op looks it up in the dispatcher), which the method guarantees by
offering a target only when its kernel is available.

`KVFORGE_DISABLE_CPU_KERNELS=1` or `KVFORGE_DISABLE_FUSED_LAYER=1` (read at import; tests and
A/B benchmarks call `set_enabled`) turn it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.kernels import cpu_fused, cpu_linear
from kvforge.kernels.build import DEFAULT_FLAG_SETS, CppKernel, kernels_disabled

__all__ = ["DISABLE_FUSED_ENV", "DecodeLayerRun", "decode_layer_available", "decode_layers_full",
           "decode_layers_given_kv", "decode_layers_kivi", "enabled", "set_enabled"]

DISABLE_FUSED_ENV = "KVFORGE_DISABLE_FUSED_LAYER"

_KERNEL = CppKernel(name="kvforge_cpu_decode_layer", source=Path(__file__).with_name("cpu_decode_layer.cpp"),
                    namespace="kvforge_cpu_layer", op="llama_decode_layers", what="fused decoder-layer op",
                    fallback="the layer's eager code", flag_sets=DEFAULT_FLAG_SETS)

_enabled = os.environ.get(DISABLE_FUSED_ENV, "").strip() in ("", "0")
_ready: bool | None = None  # the op and the linear / fused ops it calls loaded (None: not checked yet)


@dataclass(frozen=True)
class DecodeLayerRun:
    """The layers' side of one op call: per layer, 9 weights (input norm, post-attention norm,
    q, k, v, o, gate, up, down) and 7 biases (q, k, v, o, gate, up, down; None where absent),
    concatenated in layer order; the norms' eps, the step's RoPE tables and the geometry.
    Layers whose K/V are given (`decode_layers_given_kv`) have no k and v: 7 weights (input
    norm, post-attention norm, q, o, gate, up, down) and 5 biases (q, o, gate, up, down)."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int


def set_enabled(value: bool) -> None:
    """Turn the fused layer on or off for this process (tests, A/B benchmarks)."""
    global _enabled
    _enabled = bool(value)


def enabled() -> bool:
    """Whether the fused layer may run: switched on, kernels not disabled, the op built."""
    return _enabled and decode_layer_available()


def decode_layer_available() -> bool:
    """True when the op and the linear and fused ops it calls are built (builds them on the
    first call). The answer is kept once known, except while kernels are disabled (that is
    read on every call, as CppKernel.available does)."""
    global _ready
    if kernels_disabled():
        return False
    if _ready is None:
        # The op looks the others up in the dispatcher: their libraries load first.
        _ready = cpu_linear.small_m_linear_available() and cpu_fused.fused_ops_available() and _KERNEL.available()
    return _ready


def decode_layers_full(hidden: torch.Tensor, run: DecodeLayerRun, k_pages: list[torch.Tensor],
                       v_pages: list[torch.Tensor], write_slots: torch.Tensor, page_table: torch.Tensor,
                       first_page_position: torch.Tensor, visible_from: torch.Tensor, visible_to: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """The layers over a paged full-precision cache: each layer stores its K/V rows at
    `write_slots` of its pages and attends over them (`kvforge_cpu::paged_decode_attention`)."""
    return torch.ops.kvforge_cpu_layer.llama_decode_layers(
        hidden, run.weights, run.biases, run.eps, run.cos, run.sin, k_pages, v_pages, write_slots, page_table,
        first_page_position, visible_from, visible_to, scale, run.num_heads, run.num_kv_heads, run.head_dim)


def decode_layers_given_kv(hidden: torch.Tensor, run: DecodeLayerRun, k_pages: list[torch.Tensor],
                           v_pages: list[torch.Tensor], k_rows: list[torch.Tensor], v_rows: list[torch.Tensor],
                           page_table: torch.Tensor, first_page_position: torch.Tensor, visible_from: torch.Tensor,
                           visible_to: torch.Tensor, scale: float) -> torch.Tensor:
    """Layers whose K/V the step already stored in their (paged full-precision) cache layer,
    as SwiftKV's later layers: no K/V projection, no store; each attends with its queries over
    its pages and the step's post-RoPE rows `k_rows[i]`, `v_rows[i]` [B, kv_heads, D]."""
    return torch.ops.kvforge_cpu_layer.llama_decode_layers_given_kv(
        hidden, run.weights, run.biases, run.eps, run.cos, run.sin, k_pages, v_pages, k_rows, v_rows, page_table,
        first_page_position, visible_from, visible_to, scale, run.num_heads, run.num_kv_heads, run.head_dim)


def decode_layers_kivi(hidden: torch.Tensor, run: DecodeLayerRun, storage: list[torch.Tensor],
                       sinks: list[torch.Tensor | None], plan: tuple[torch.Tensor, ...],
                       settings: tuple[float, int, int, int, int]
                       ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The layers over KIVI storage (8 tensors and 2 sinks per layer; plan: page_table,
    first_page_position, visible_from, lengths, slots; settings: scale, bits, value_bits,
    key_dot, value_dot codes). Returns the output and each layer's post-RoPE k and v rows,
    which the cache stores at the end of the step as its `write` would have kept them."""
    return torch.ops.kvforge_cpu_layer.llama_decode_layers_kivi(
        hidden, run.weights, run.biases, run.eps, run.cos, run.sin, storage, sinks, *plan, *settings,
        run.num_heads, run.num_kv_heads, run.head_dim)
