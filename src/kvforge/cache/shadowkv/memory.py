"""What the `shadowkv` cache method's storage costs: the bytes one sequence holds in each
store (`ShadowKVSizes`, known before the budget is split between the stores) and the
method's `MemorySpec` once the split is made (`ShadowKVMemorySpec`).

A sequence of n tokens holds at most, fast tier: its exact pages (global layers, until it is
compressed), its sliding-window pages, and once n >= min_context its chunk pages (landmarks)
and per-sequence state (bases, key coefficients, exact buffers, reuse caches); slow tier:
its chunks' values. The step that compresses a sequence holds its exact pages and its
compressed state at once, so `sequence_bytes(n)` is exact(n) + compressed(n) once
n >= min_context, and exact(n) below it.

Ranks: with rank=auto a layer's rank is known only once its keys are seen, so everything
planned before compression (the split, `sequence_bytes`, a compression's reservation,
reserving admission) counts the largest rank (the KV width); compression then returns
what its actual ranks do not use (allocator.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvforge.cache.layout import CacheLayout
from kvforge.cache.memory import MemorySpec
from kvforge.cache.page_table import LayerGroups
from kvforge.cache.shadowkv.config import ShadowKVConfig
from kvforge.cache.shadowkv.split import PARTS
from kvforge.cache.shadowkv.state import fixed_state_bytes


def paged_sequence_bytes(layout: CacheLayout | None, block_size: int, element: int, num_tokens: int,
                         during_step: bool = True) -> int:
    """Bytes an inner `full` cache over `layout` (0 without one) holds for one sequence at
    most: during a step (`max_pages_during_step`: its share must hold the sliding windows'
    transient pages), or between steps (its `sequence_bytes`); known before the cache is
    built (its budget depends on it)."""
    if layout is None:
        return 0
    groups = LayerGroups.from_layout(layout)
    page = groups.group_size * block_size * 2 * layout.num_kv_heads * layout.head_dim * element
    count = groups.max_pages_during_step if during_step else groups.max_pages_per_sequence
    return count(block_size, num_tokens) * page


def chunk_page_bytes(num_global: int, kv_heads: int, head_dim: int, chunk: int,
                     element: int) -> tuple[int, int]:
    """(fast, slow) bytes of one chunk page over `num_global` global layers. Fast per layer:
    one landmark per KV head and a candidate flag per KV head (one byte); slow: the chunk's
    values. (Key coefficients are per-sequence state: their rank differs per layer.)"""
    fast = num_global * (kv_heads * head_dim * element + kv_heads)
    slow = num_global * kv_heads * chunk * head_dim * element
    return fast, slow


@dataclass(frozen=True)
class ShadowKVSizes:
    """Bytes of one sequence per store, from the options and the layout alone."""

    layout: CacheLayout
    config: ShadowKVConfig
    rank_bounds: tuple[int, int]  # (least, most) rank of a layer
    element: int  # bytes per stored element (compute dtype)
    coefficient_element: int  # bytes per stored key coefficient
    global_layers: tuple[int, ...]
    sliding_layers: tuple[int, ...]
    exact_layout: CacheLayout | None  # the inner caches' layouts (None: no such layers)
    sliding_layout: CacheLayout | None
    fast_chunk_bytes: int
    slow_chunk_bytes: int

    def bytes_per_token(self, cache_layer: int) -> float:
        """Fast-tier bytes per stored token: compressed rate for global layers (coefficients
        at the largest rank + landmark share; values are on the slow tier), exact K and V
        for sliding layers."""
        if cache_layer in self.sliding_layers:
            return float(2 * self.layout.num_kv_heads * self.layout.head_dim * self.element)
        landmarks = self.fast_chunk_bytes / len(self.global_layers) / self.config.chunk
        return landmarks + self.rank_bounds[1] * self.coefficient_element

    def sequence_parts(self, num_tokens: int) -> dict[str, int]:
        """What a sequence of `num_tokens` tokens holds at most in each store (split.PARTS):
        exact and sliding pages, and once it may compress, its chunk pages and fixed state."""
        config, block = self.config, self.config.block_size
        parts = {"exact": paged_sequence_bytes(self.exact_layout, block, self.element, num_tokens),
                 "sliding": paged_sequence_bytes(self.sliding_layout, block, self.element, num_tokens),
                 "chunks": 0, "fixed": 0}
        if self.exact_layout is not None and num_tokens >= config.min_context:
            chunks = math.ceil(num_tokens / config.chunk)
            parts["chunks"] = chunks * self.fast_chunk_bytes
            parts["fixed"] = self.fixed_state_bytes(num_tokens, chunks)
        return parts

    def fixed_state_bytes(self, num_tokens: int, num_chunks: int, ranks: Sequence[int] | None = None) -> int:
        """Per-sequence state of a sequence compressed at `num_tokens` into `num_chunks`
        chunks, at `ranks` per global layer (None: the largest rank everywhere)."""
        layout, config = self.layout, self.config
        if ranks is None:
            ranks = [self.rank_bounds[1]] * len(self.global_layers)
        return fixed_state_bytes(ranks, layout.num_kv_heads, layout.head_dim, config.chunk,
                                 min(config.outliers, num_chunks), config.window_capacity,
                                 config.budget_tokens(num_tokens, layout.num_kv_heads) // config.chunk, num_chunks,
                                 self.element, self.coefficient_element)

    def compressed_chunks(self, num_tokens: int) -> int:
        """Chunks a sequence compressed at `num_tokens` tokens holds: its prefix
        [0, (n // chunk) x chunk - local)."""
        chunk = self.config.chunk
        return ((num_tokens // chunk) * chunk - self.config.local) // chunk

    def fold_count(self, window: int) -> int:
        """Whole chunks folded when the exact tail holds `window` tokens after a step: the
        fewest (oldest first) that bring it back to at most local + generated_window. The
        tail thus slides: the most recent capacity - chunk + 1 tokens or more always stay
        exact (folding all but `local` tokens at once was worse: right after such a fold
        the recent tokens compete for the sparse budget; docs/benchmarks.md)."""
        excess = window - self.config.window_capacity
        return 0 if excess <= 0 else math.ceil(excess / self.config.chunk)

    def compressed_global_bytes(self, num_tokens: int, rank: int | list[int] | None = None) -> int:
        """Fast-tier bytes of the compressed (global) layers of a sequence right after it is
        compressed at `num_tokens` tokens (>= min_context), with every layer at `rank` (a
        list: one per global layer; None: the largest rank)."""
        chunks = self.compressed_chunks(num_tokens)
        ranks = [rank] * len(self.global_layers) if isinstance(rank, int) else rank
        return chunks * self.fast_chunk_bytes + self.fixed_state_bytes(num_tokens, chunks, ranks)


@dataclass(frozen=True)
class ShadowKVMemorySpec(MemorySpec):
    """The sizes, and the capacity of each store once the budget is split (split.py)."""

    num_cache_layers: int
    sizes: ShadowKVSizes
    store_capacity: dict[str, int]  # per store of split.PARTS, fast-tier bytes
    budget_bytes: int  # the fast tier
    slow_bytes: int  # the chunk store's values

    def bytes_per_token(self, cache_layer: int) -> float:
        return self.sizes.bytes_per_token(cache_layer)

    def sequence_bytes(self, num_tokens: int) -> int:
        return sum(self.sizes.sequence_parts(num_tokens).values())

    def fits_together(self, token_counts: Sequence[int]) -> bool:
        parts = [self.sizes.sequence_parts(n) for n in token_counts]
        return all(sum(p[name] for p in parts) <= self.store_capacity[name] for name in PARTS)

    @property
    def capacity(self) -> dict[str, int]:
        return {"fast": self.budget_bytes, "slow": self.slow_bytes}

    def sequences_held(self, num_tokens: int) -> int:
        """Compressed sequences hold no exact pages in their global layers (`fits_together`
        counts them at their compression step, when they still do): as many as the chunk
        pages' (as many as both tiers hold), per-sequence state's and sliding windows' shares
        hold, provided that one such sequence fits alone (its prompt is prefilled exactly).
        Shorter than min_context, sequences stay exact: as `fits_together` says."""
        parts = self.sizes.sequence_parts(num_tokens)
        if not parts["chunks"]:
            return super().sequences_held(num_tokens)
        if not self.fits_together([num_tokens]):
            return 0
        return min(self.store_capacity[name] // parts[name] for name in ("sliding", "chunks", "fixed") if parts[name])

    def compressed_global_bytes(self, num_tokens: int, rank: int | list[int] | None = None) -> int:
        return self.sizes.compressed_global_bytes(num_tokens, rank)

    def compressed_sequence_bytes(self, num_tokens: int, rank: int | list[int] | None = None) -> dict[str, int]:
        """Bytes per tier a sequence of `num_tokens` tokens holds right after compression
        (exact below min_context) with every layer at `rank` (as `compressed_global_bytes`):
        what `kvforge info` reports."""
        sizes = self.sizes
        exact_pages = [paged_sequence_bytes(layout, sizes.config.block_size, sizes.element, num_tokens, False)
                       for layout in (sizes.exact_layout, sizes.sliding_layout)]
        if sizes.exact_layout is None or num_tokens < sizes.config.min_context:
            return {"fast": sum(exact_pages), "slow": 0}
        fast = sizes.compressed_global_bytes(num_tokens, rank) + exact_pages[1]
        return {"fast": fast, "slow": sizes.compressed_chunks(num_tokens) * sizes.slow_chunk_bytes}

