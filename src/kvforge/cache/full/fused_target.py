"""What the fused decode op needs of one `full` cache layer (kernels/cpu_decode_layer.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvforge.cache.base import FusedDecodeTarget
from kvforge.kernels.cpu_decode_layer import DecodeLayerRun, decode_layers_full


@dataclass(frozen=True)
class FullFusedTarget(FusedDecodeTarget):
    """The layer's pages, and its group's plan (write_slots, page_table, first_page_position,
    visible_from, visible_to); settings: the softmax scale."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    plan: tuple[torch.Tensor, ...]
    settings: tuple[float]

    @classmethod
    def run_layers(cls, targets: Sequence[FusedDecodeTarget], hidden: torch.Tensor,
                   layers: DecodeLayerRun) -> torch.Tensor:
        first = targets[0]
        assert isinstance(first, FullFusedTarget)
        return decode_layers_full(hidden, layers, [t.k_pages for t in targets], [t.v_pages for t in targets],  # type: ignore[attr-defined]
                                  *first.plan, first.settings[0])
