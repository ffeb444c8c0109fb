"""Memory accounting of the `shadowkv` cache method: bytes per token and per sequence, the
reservations `allocate` makes for a step, and the two tiers' usage and capacity.

What `allocate` checks, all-or-nothing:
  fast = inner exact pages + inner sliding pages + chunk pages x fast chunk bytes
         + per-sequence state (bases, key coefficients, exact buffers, reuse caches) of
         compressed sequences and of those reserved to compress in the coming step
         <= kv budget;
  slow = chunk pages x slow chunk bytes <= slow budget (a fixed number of chunk pages);
and each store within its share of the budget (split.py): exact and sliding pages within
their inner caches' pools, chunk pages within the store, fixed state within its share.
The step that compresses a sequence holds its exact pages and its compressed state at
once (the exact pages are freed at the end of it). `allocate` cannot know whether a step
will compress (it does not see the logit rows), so every step that leaves an exact
sequence with n >= min_context tokens reserves the compressed state of n tokens; a step
that does not compress returns the reservation at end_step. `sequence_bytes(n)` is
therefore exact(n) + compressed(n) once n >= min_context, and exact(n) below it.

Ranks: with rank=auto a layer's rank is known only once its keys are seen, so everything
planned before compression (the split, `sequence_bytes`, a compression's reservation,
reserving admission) counts the largest rank (the KV width); compression then returns
what its actual ranks do not use. A fold that outgrows a layer's coefficient storage
reserves the next block at the sequence's own ranks.

`ShadowKVMemory` is a mixin of `ShadowKVCache` (shadowkv.py), which owns the state it
reads: the inner exact/sliding `full` caches, the chunk store and the sequence table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvforge.cache.block_pool import BlockPool
from kvforge.cache.full.method import FullCache
from kvforge.cache.layout import CacheLayout
from kvforge.cache.page_table import LayerGroups, PageTable
from kvforge.cache.shadowkv.config import ShadowKVConfig
from kvforge.cache.shadowkv.split import PARTS, BudgetSplit
from kvforge.cache.shadowkv.state import (
    CompressedSequence,
    coefficient_bytes,
    fixed_state_bytes,
    grown_capacity,
)
from kvforge.cache.shadowkv.store import ChunkStore


def paged_sequence_bytes(layout: CacheLayout | None, block_size: int, element: int, num_tokens: int) -> int:
    """Bytes an inner `full` cache over `layout` (0 without one) holds for one sequence at
    most, during a step too (`max_pages_during_step`: its share must hold the sliding
    windows' transient pages); known before the cache is built (its budget depends on it)."""
    if layout is None:
        return 0
    groups = LayerGroups.from_layout(layout)
    page = groups.group_size * block_size * 2 * layout.num_kv_heads * layout.head_dim * element
    return PageTable(BlockPool(1), block_size, groups).max_pages_during_step(num_tokens) * page


def chunk_page_bytes(num_global: int, kv_heads: int, head_dim: int, chunk: int,
                     element: int) -> tuple[int, int]:
    """(fast, slow) bytes of one chunk page over `num_global` global layers. Fast per layer:
    one landmark per KV head and a candidate flag per KV head (one byte); slow: the chunk's
    values. (Key coefficients are per-sequence state: their rank differs per layer.)"""
    fast = num_global * (kv_heads * head_dim * element + kv_heads)
    slow = num_global * kv_heads * chunk * head_dim * element
    return fast, slow


@dataclass
class Reservation:
    """What `allocate` prepared for the step that brings the sequence to `target` tokens."""

    target: int
    compress: bool
    # Chunk pages held back for compression or folding. A count, not ids: the ids are
    # taken when the chunks are written, so a sequence compressed in one go gets one run
    # of consecutive pages (landmarks then read in place, see ChunkStore.gather_landmarks).
    pages: int
    # per-sequence state reserved for compression (at the largest rank) or for the next
    # block of coefficient storage a fold needs
    fixed_bytes: int


@dataclass
class SequenceEntry:
    num_tokens: int = 0
    compressed: CompressedSequence | None = None
    reservation: Reservation | None = None


class ShadowKVMemory:
    """Accounting half of `ShadowKVCache`; the attributes below are set by its constructor."""

    layout: CacheLayout
    config: ShadowKVConfig
    rank_bounds: tuple[int, int]  # (least, most) rank of a layer
    element: int  # bytes per stored element (compute dtype)
    coefficient_element: int  # bytes per stored key coefficient (coefficient_dtype)
    budget_bytes: int  # fast tier
    global_layers: list[int]
    sliding_layers: list[int]
    exact: FullCache | None  # global layers of sequences not yet compressed
    sliding: FullCache | None  # sliding-window layers
    exact_layout: CacheLayout | None  # their layouts (None: no such layers)
    sliding_layout: CacheLayout | None
    split: BudgetSplit
    store: ChunkStore | None
    fast_chunk_bytes: int
    slow_chunk_bytes: int
    _seqs: dict[int, SequenceEntry]
    _fixed_bytes: int  # per-sequence state of compressed + reserved sequences
    _reserved_pages: int  # chunk pages promised to reservations, not yet taken

    def bytes_per_token(self, cache_layer: int) -> float:
        """Fast-tier bytes per stored token: compressed rate for global layers (coefficients
        at the largest rank + landmark share; values are on the slow tier), exact K and V
        for sliding layers."""
        if cache_layer in self.sliding_layers:
            return float(2 * self.layout.num_kv_heads * self.layout.head_dim * self.element)
        landmarks = self.fast_chunk_bytes / len(self.global_layers) / self.config.chunk
        return landmarks + self.rank_bounds[1] * self.coefficient_element

    def sequence_bytes(self, num_tokens: int) -> int:
        return sum(self._sequence_parts(num_tokens).values())

    def _sequence_parts(self, num_tokens: int) -> dict[str, int]:
        """What a sequence of `num_tokens` tokens holds at most in each store (split.PARTS):
        exact and sliding pages, and once it may compress, its chunk pages and fixed state."""
        config, block = self.config, self.config.block_size
        parts = {"exact": paged_sequence_bytes(self.exact_layout, block, self.element, num_tokens),
                 "sliding": paged_sequence_bytes(self.sliding_layout, block, self.element, num_tokens),
                 "chunks": 0, "fixed": 0}
        if self.exact_layout is not None and num_tokens >= config.min_context:
            chunks = math.ceil(num_tokens / config.chunk)
            parts["chunks"] = chunks * self.fast_chunk_bytes
            parts["fixed"] = self._fixed_state_bytes(num_tokens, chunks)
        return parts

    def _exact_sequence_bytes(self, num_tokens: int) -> int:
        return sum(c.sequence_bytes(num_tokens) for c in (self.exact, self.sliding) if c is not None)

    def _fixed_state_bytes(self, num_tokens: int, num_chunks: int, ranks: list[int] | None = None) -> int:
        """Per-sequence state of a sequence compressed at `num_tokens` into `num_chunks`
        chunks, at `ranks` per global layer (None: the largest rank everywhere)."""
        layout, config = self.layout, self.config
        if ranks is None:
            ranks = [self.rank_bounds[1]] * len(self.global_layers)
        return fixed_state_bytes(ranks, layout.num_kv_heads, layout.head_dim, config.chunk,
                                 min(config.outliers, num_chunks), config.window_capacity,
                                 config.budget_tokens(num_tokens, layout.num_kv_heads) // config.chunk, num_chunks, self.element,
                                 self.coefficient_element)

    def _fast_used(self) -> int:
        used = self._fixed_bytes
        for inner in (self.exact, self.sliding):
            if inner is not None:
                used += inner.pages.pool.num_used * inner.page_bytes
        if self.store is not None:
            used += (self.store.pool.num_used + self._reserved_pages) * self.fast_chunk_bytes
        return used

    def fits_together(self, token_counts: Sequence[int]) -> bool:
        parts = [self._sequence_parts(n) for n in token_counts]
        capacity = {"exact": self.exact.memory_capacity()["fast"] if self.exact is not None else 0,
                    "sliding": self.sliding.memory_capacity()["fast"] if self.sliding is not None else 0,
                    "chunks": self.store.num_pages * self.fast_chunk_bytes if self.store is not None else 0,
                    "fixed": self.split.fixed}
        return all(sum(p[name] for p in parts) <= capacity[name] for name in PARTS)

    def memory_usage(self) -> dict[str, int]:
        slow = (self.store.pool.num_used + self._reserved_pages) * self.slow_chunk_bytes if self.store is not None else 0
        return {"fast": self._fast_used(), "slow": slow}

    def memory_capacity(self) -> dict[str, int]:
        slow = self.store.num_pages * self.slow_chunk_bytes if self.store is not None else 0
        return {"fast": self.budget_bytes, "slow": slow}

    def compressed_sequence_bytes(self, num_tokens: int, rank: int | list[int] | None = None) -> dict[str, int]:
        """Bytes per tier a sequence of `num_tokens` tokens holds right after compression
        (exact below min_context) with every layer at `rank` (a list: one per global layer;
        None: the largest rank): what `kvforge info` reports."""
        if self.exact is None or num_tokens < self.config.min_context:
            return {"fast": self._exact_sequence_bytes(num_tokens), "slow": 0}
        chunks = self._compressed_chunks(num_tokens)
        fast = self.compressed_global_bytes(num_tokens, rank)
        if self.sliding is not None:
            fast += self.sliding.sequence_bytes(num_tokens)
        return {"fast": fast, "slow": chunks * self.slow_chunk_bytes}

    def compressed_global_bytes(self, num_tokens: int, rank: int | list[int] | None = None) -> int:
        """Fast-tier bytes of the compressed (global) layers of a sequence right after it is
        compressed at `num_tokens` tokens (>= min_context), at `rank` as above."""
        chunks = self._compressed_chunks(num_tokens)
        ranks = [rank] * len(self.global_layers) if isinstance(rank, int) else rank
        return chunks * self.fast_chunk_bytes + self._fixed_state_bytes(num_tokens, chunks, ranks)

    def _compressed_chunks(self, num_tokens: int) -> int:
        chunk = self.config.chunk
        return ((num_tokens // chunk) * chunk - self.config.local) // chunk

    def _fold_count(self, window: int) -> int:
        """Whole chunks folded when the exact tail holds `window` tokens after a step: the
        fewest (oldest first) that bring it back to at most local + generated_window. The
        tail thus slides: the most recent capacity - chunk + 1 tokens or more always stay
        exact. (Folding all but `local` tokens at once was measured worse: right after such
        a fold the recent tokens compete for the sparse budget. gemma3-270m decode
        perplexity at 8K with exact keys (rank = width, default budget): +4.1% of full
        that way, +3.1% this way.)"""
        excess = window - self.config.window_capacity
        return 0 if excess <= 0 else math.ceil(excess / self.config.chunk)

    def _plan(self, seq_id: int, num_tokens: int) -> tuple[int, int, bool, int]:
        """(fast bytes of inner pages, chunk pages, compress, fixed bytes) the step needs."""
        seq = self._seqs.get(seq_id)
        cached = seq.num_tokens if seq is not None else 0
        inner_bytes = 0
        if self.sliding is not None:
            inner_bytes += self.sliding.pages.pages_for_growth(seq_id, num_tokens) * self.sliding.page_bytes
        if seq is not None and seq.compressed is not None:
            state = seq.compressed
            folds = self._fold_count(state.window + num_tokens - cached)
            grown = grown_capacity(state.coefficient_capacity, state.num_chunks + folds)
            growth = coefficient_bytes(state.ranks, self.config.chunk, grown - state.coefficient_capacity,
                                       self.coefficient_element)
            return inner_bytes, folds, False, growth
        if self.exact is None:
            return inner_bytes, 0, False, 0
        inner_bytes += self.exact.pages.pages_for_growth(seq_id, num_tokens) * self.exact.page_bytes
        if num_tokens >= self.config.min_context:  # this step may compress (see the module doc)
            chunks = self._compressed_chunks(num_tokens)
            return inner_bytes, chunks, True, self._fixed_state_bytes(num_tokens, chunks)
        return inner_bytes, 0, False, 0

    def _reserved_bytes(self, reservation: Reservation | None) -> tuple[int, int]:
        if reservation is None:
            return 0, 0
        return reservation.pages * self.fast_chunk_bytes + reservation.fixed_bytes, reservation.pages

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.reservation is not None and seq.reservation.target == num_tokens:
            return True
        inner_bytes, chunk_pages, _, fixed = self._plan(seq_id, num_tokens)
        old_bytes, old_pages = self._reserved_bytes(seq.reservation if seq is not None else None)
        needed = inner_bytes + chunk_pages * self.fast_chunk_bytes + fixed
        if self._fast_used() - old_bytes + needed > self.budget_bytes:
            return False
        # Each store holds only its share of the budget (split.py).
        if not all(inner.can_allocate(seq_id, num_tokens) for inner in self._growing(seq)):
            return False
        old_fixed = seq.reservation.fixed_bytes if seq is not None and seq.reservation is not None else 0
        if self._fixed_bytes - old_fixed + fixed > self.split.fixed:
            return False
        if chunk_pages == 0:
            return True
        free = self.store.pool.num_free - self._reserved_pages + old_pages if self.store is not None else 0
        return chunk_pages <= free

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        if not self.can_allocate(seq_id, num_tokens):
            return False
        seq = self._seqs.setdefault(seq_id, SequenceEntry())
        if seq.reservation is not None and seq.reservation.target == num_tokens:
            return True
        _, chunk_pages, compress, fixed = self._plan(seq_id, num_tokens)
        self._release_reservation(seq)
        for inner in self._growing(seq):
            grown = inner.allocate(seq_id, num_tokens)
            assert grown, "checked by can_allocate"
        seq.reservation = Reservation(num_tokens, compress, chunk_pages, fixed)
        self._reserved_pages += chunk_pages
        self._fixed_bytes += fixed
        return True

    def _growing(self, seq: SequenceEntry | None) -> list[FullCache]:
        """The inner caches a step of this sequence stores tokens in."""
        compressed = seq is not None and seq.compressed is not None
        return [inner for inner in (self.sliding, None if compressed else self.exact) if inner is not None]

    def _release_reservation(self, seq: SequenceEntry) -> None:
        if seq.reservation is None:
            return
        self._reserved_pages -= seq.reservation.pages
        self._fixed_bytes -= seq.reservation.fixed_bytes
        seq.reservation = None

    def _take_pages(self, reservation: Reservation, count: int) -> list[int]:
        """Turn `count` reserved chunk pages into page ids (ascending)."""
        assert self.store is not None and count <= reservation.pages
        reservation.pages -= count
        self._reserved_pages -= count
        return sorted(self.store.pool.allocate(count))
