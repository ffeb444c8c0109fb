"""What the fused decode op (kernels/cpu_decode_layer.py) needs of one KIVI cache layer in a
decode-only step: its storage tensors, the group's decode plan and the kernel's settings,
in the order `decode_layers_kivi` takes them.

`KIVICache.fused_decode_target` decides whether a step and a cache qualify at all; this
module only assembles a qualifying layer's target, or refuses storage the op cannot read
in place (the eager call would copy it: `cpu_decode.kivi_decode_attention_cpu`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvforge.cache.base import FusedDecodeTarget
from kvforge.cache.kivi.cpu_decode import KEY_DOT_CODES, VALUE_DOT_CODES
from kvforge.cache.kivi.plan import Decode, KiviStepMetadata
from kvforge.cache.kivi.store import KIVILayerView
from kvforge.kernels.cpu_decode_layer import DecodeLayerRun, decode_layers_kivi


@dataclass(frozen=True, eq=False)
class KiviFusedTarget(FusedDecodeTarget):
    """One layer's storage (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res)
    and sinks (or None); the group's decode plan (page_table, first_page_position,
    visible_from, lengths, slots); settings (scale, bits, value_bits, key_dot, value_dot
    codes). After the op each layer's k and v go to `meta.step_kv`, as its `write` would have
    kept them for `end_step`."""

    cache_layer: int
    storage: tuple[torch.Tensor, ...]
    sinks: tuple[torch.Tensor | None, torch.Tensor | None]
    plan: tuple[torch.Tensor, ...]
    settings: tuple[float, int, int, int, int]
    meta: KiviStepMetadata

    @classmethod
    def run_layers(cls, targets: Sequence[FusedDecodeTarget], hidden: torch.Tensor,
                   layers: DecodeLayerRun) -> torch.Tensor:
        kivi = [t for t in targets if isinstance(t, KiviFusedTarget)]
        assert len(kivi) == len(targets), "a run joins targets of one type"
        storage = [tensor for t in kivi for tensor in t.storage]
        sinks = [sink for t in kivi for sink in t.sinks]
        out, keys, values = decode_layers_kivi(hidden, layers, storage, sinks, kivi[0].plan, kivi[0].settings)
        for target, k, v in zip(kivi, keys, values):
            target.meta.step_kv[target.cache_layer] = (k, v)
        return out


def layer_target(cache_layer: int, view: KIVILayerView, decode: Decode, scale: float, key_dot: str,
                 value_dot: str, meta: KiviStepMetadata) -> KiviFusedTarget | None:
    """The layer's target, or None when a plan tensor is not contiguous int64 on the CPU or a
    storage tensor is not contiguous (then the eager path, which converts, must run)."""
    steps = (decode.page_table, decode.first_page_position, decode.visible_from, decode.lengths, decode.slots)
    storage = (view.k_codes, view.k_scale, view.k_zero, view.v_codes, view.v_scale, view.v_zero, view.k_res,
               view.v_res)
    if not all(t.is_cpu and t.is_contiguous() for t in (*steps, *storage)) or any(
            t.dtype != torch.int64 for t in steps):
        return None
    settings = (float(scale), int(view.bits), int(view.vbits), KEY_DOT_CODES[key_dot], VALUE_DOT_CODES[value_dot])
    return KiviFusedTarget(cache_layer, storage, (view.k_sink, view.v_sink), steps, settings, meta)
