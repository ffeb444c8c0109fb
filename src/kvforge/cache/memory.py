"""What a cache method's storage costs, declared once: the `MemorySpec` role of the cache
interface (base.py).

A method builds its spec at construction from its options and its budget, and nothing in
it changes while the cache runs. Admission (`LLMEngine`'s reserving admission and its
refusal of prompts that fit nowhere), `kvforge info` and the benchmarks read only this;
how much is in use now is the allocator's business (`CacheMethod.memory_usage`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class MemorySpec(ABC):
    num_cache_layers: int

    @abstractmethod
    def bytes_per_token(self, cache_layer: int) -> float:
        """Bytes one stored token costs in one cache layer (K and V, all KV heads)."""

    def kv_bytes_per_token(self) -> float:
        """Bytes one token costs over all cache layers, ignoring sliding-window bounds."""
        return sum(self.bytes_per_token(layer) for layer in range(self.num_cache_layers))

    @abstractmethod
    def sequence_bytes(self, num_tokens: int) -> int:
        """Bytes a sequence of `num_tokens` tokens holds at most (windows bound it)."""

    @property
    @abstractmethod
    def capacity(self) -> dict[str, int]:
        """Bytes available per storage tier, e.g. {"fast": ..., "slow": ...} (the budget)."""

    def fits_together(self, token_counts: Sequence[int]) -> bool:
        """Whether sequences of these lengths fit the cache at once, each holding at most what
        `sequence_bytes` says (reserving admission; a prompt that fits nowhere is refused).
        Methods whose budget is split between stores check every store."""
        return sum(self.sequence_bytes(n) for n in token_counts) <= self.capacity["fast"]

    def sequences_held(self, num_tokens: int) -> int:
        """The most sequences of `num_tokens` tokens the cache holds at once as it keeps them
        for decoding (here: as `fits_together` says; at most what the bytes alone allow)."""
        lo, hi = 0, self.capacity["fast"] // max(1, self.sequence_bytes(num_tokens))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits_together([num_tokens] * mid) else (lo, mid - 1)
        return lo
