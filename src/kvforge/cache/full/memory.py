"""The `full` cache method's memory declaration: pages of one block pool on the fast tier."""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.cache.memory import MemorySpec
from kvforge.cache.page_table import LayerGroups


@dataclass(frozen=True)
class PagedMemorySpec(MemorySpec):
    """Every stored token costs `token_layer_bytes` per cache layer; storage is `num_pages`
    pages of `page_bytes` (one page: `block_size` tokens of every layer of a group)."""

    num_cache_layers: int
    groups: LayerGroups
    block_size: int
    token_layer_bytes: int
    page_bytes: int
    num_pages: int

    def bytes_per_token(self, cache_layer: int) -> float:
        return float(self.token_layer_bytes)

    def sequence_bytes(self, num_tokens: int) -> int:
        return self.groups.max_pages_per_sequence(self.block_size, num_tokens) * self.page_bytes

    @property
    def capacity(self) -> dict[str, int]:
        return {"fast": self.num_pages * self.page_bytes, "slow": 0}
