"""What the fused decode op needs of one `full` cache layer (kernels/cpu_decode_layer.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvforge.cache.base import FusedDecodeTarget
from kvforge.kernels.cpu_decode_layer import DecodeLayerRun, decode_layers_full, decode_layers_given_kv


@dataclass(frozen=True)
class FullFusedTarget(FusedDecodeTarget):
    """The layer's pages, and its group's plan (write_slots, page_table, first_page_position,
    visible_from, visible_to); settings: the softmax scale; step_kv: the step's post-RoPE K/V
    of the layer as `write` kept them, when written before the target was asked for."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    plan: tuple[torch.Tensor, ...]
    settings: tuple[float]
    step_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def given_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.step_kv

    @classmethod
    def run_layers(cls, targets: Sequence[FusedDecodeTarget], hidden: torch.Tensor,
                   layers: DecodeLayerRun) -> torch.Tensor:
        first = targets[0]
        assert isinstance(first, FullFusedTarget)
        return decode_layers_full(hidden, layers, [t.k_pages for t in targets], [t.v_pages for t in targets],  # type: ignore[attr-defined]
                                  *first.plan, first.settings[0])

    @classmethod
    def run_layers_given_kv(cls, targets: Sequence[FusedDecodeTarget], hidden: torch.Tensor,
                            layers: DecodeLayerRun) -> torch.Tensor:
        full = [t for t in targets if isinstance(t, FullFusedTarget) and t.step_kv is not None]
        assert len(full) == len(targets), "a run joins targets of one type, each with its step's K/V"
        return decode_layers_given_kv(hidden, layers, [t.k_pages for t in full], [t.v_pages for t in full],
                                      [t.step_kv[0] for t in full], [t.step_kv[1] for t in full],  # type: ignore[index]
                                      *full[0].plan[1:], full[0].settings[0])
