"""The `kivi` cache method's memory declaration and token counts.

With n tokens held, keys of [0, nk) and values of [0, nv) are quantised,
nk = (n // R) * R and nv = max(0, n - R); pages (G tokens) are held for [0, nk) only. Each
sequence also owns one residual slot (K and V rings of R tokens and the sink buffers, every
cache layer), costing `slot_pages` pages of the budget, out of `num_slots`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvforge.cache.memory import MemorySpec
from kvforge.cache.page_table import LayerGroups


def quantized_keys(num_tokens: int, residual: int) -> int:
    """nk: tokens whose keys are quantised when a sequence holds `num_tokens`."""
    return (num_tokens // residual) * residual


def quantized_values(num_tokens: int, residual: int) -> int:
    """nv: tokens whose values are quantised when a sequence holds `num_tokens`."""
    return max(0, num_tokens - residual)


@dataclass(frozen=True)
class KiviMemorySpec(MemorySpec):
    num_cache_layers: int
    groups: LayerGroups
    key_tokens: int  # G: tokens per page
    residual: int  # R
    page_bytes: int
    slot_pages: int  # the budget's pages one residual slot costs
    num_slots: int
    num_pages: int  # quantised pages (the budget less the slots)

    def bytes_per_token(self, cache_layer: int) -> float:
        """Quantised bytes per stored token and cache layer (codes + float16 scale/zero)."""
        return self.page_bytes / (self.key_tokens * self.groups.group_size)

    def pages_of(self, num_tokens: int) -> int:
        """Quantised pages a sequence of `num_tokens` tokens holds at most."""
        return self.groups.max_pages_per_sequence(self.key_tokens, quantized_keys(num_tokens, self.residual))

    def sequence_bytes(self, num_tokens: int) -> int:
        return (self.pages_of(num_tokens) + self.slot_pages) * self.page_bytes

    def fits_together(self, token_counts: Sequence[int]) -> bool:
        pages = sum(self.pages_of(n) for n in token_counts)
        return len(token_counts) <= self.num_slots and pages <= self.num_pages

    @property
    def capacity(self) -> dict[str, int]:
        return {"fast": (self.num_pages + self.slot_pages * self.num_slots) * self.page_bytes, "slow": 0}
