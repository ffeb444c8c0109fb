"""What the fused decoder-layer op (kernels/cpu_decode_layer.py) needs of one KIVI cache layer
in a decode-only step: its storage tensors, the group's decode plan and the kernel's
settings, in the order `llama_decode_layers_kivi` takes them (`KiviLayerTarget`).

`KIVICache.fused_decode_target` decides whether a step and a cache qualify at all; this
module only assembles a qualifying layer's target, or refuses storage the op cannot read
in place (the eager call would copy it: `cpu_decode.kivi_decode_attention_cpu`)."""

from __future__ import annotations

import torch

from kvforge.cache.kivi.cpu_decode import KEY_DOT_CODES, VALUE_DOT_CODES
from kvforge.cache.kivi.plan import Decode
from kvforge.cache.kivi.store import KIVILayerView
from kvforge.kernels.cpu_decode_layer import KiviLayerTarget


def layer_target(cache_layer: int, view: KIVILayerView, decode: Decode, scale: float, key_dot: str,
                 value_dot: str) -> KiviLayerTarget | None:
    """The layer's target, or None when a plan tensor is not contiguous int64 on the CPU or a
    storage tensor is not contiguous (then the eager path, which converts, must run)."""
    steps = (decode.page_table, decode.first_page_position, decode.visible_from, decode.lengths, decode.slots)
    storage = (view.k_codes, view.k_scale, view.k_zero, view.v_codes, view.v_scale, view.v_zero, view.k_res,
               view.v_res)
    if not all(t.is_cpu and t.is_contiguous() for t in (*steps, *storage)) or any(
            t.dtype != torch.int64 for t in steps):
        return None
    settings = (float(scale), int(view.bits), int(view.vbits), KEY_DOT_CODES[key_dot], VALUE_DOT_CODES[value_dot])
    return KiviLayerTarget(cache_layer, storage, (view.k_sink, view.v_sink), steps, settings)
