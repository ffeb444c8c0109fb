"""The allocator half of the `shadowkv` cache method: the reservations `allocate` makes for a
step, and the two tiers' usage.

What `allocate` checks, all-or-nothing:
  fast = inner exact pages + inner sliding pages + chunk pages x fast chunk bytes
         + per-sequence state of compressed sequences and of those reserved to compress in
         the coming step
         <= kv budget;
  slow = chunk pages x slow chunk bytes <= slow budget (a fixed number of chunk pages);
and each store within its share of the budget (split.py): exact and sliding pages within
their inner caches' pools, chunk pages within the store, fixed state within its share.
`allocate` cannot know whether a step will compress (it does not see the logit rows), so
every step that leaves an exact sequence with n >= min_context tokens reserves the
compressed state of n tokens; a step that does not compress returns the reservation at
end_step. A fold that outgrows a layer's coefficient storage reserves the next block at
the sequence's own ranks.

`ShadowKVAllocator` is a mixin of `ShadowKVCache` (method.py), which owns the state it
reads: the inner exact/sliding `full` caches, the chunk store and the sequence table.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.cache.full.method import FullCache
from kvforge.cache.shadowkv.memory import ShadowKVMemorySpec
from kvforge.cache.shadowkv.split import BudgetSplit
from kvforge.cache.shadowkv.state import CompressedSequence, coefficient_bytes, grown_capacity
from kvforge.cache.shadowkv.store import ChunkStore


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


class ShadowKVAllocator:
    """Reservations and usage of `ShadowKVCache`; the attributes below are set by its constructor."""

    memory: ShadowKVMemorySpec
    budget_bytes: int  # fast tier
    exact: FullCache | None  # global layers of sequences not yet compressed
    sliding: FullCache | None  # sliding-window layers
    split: BudgetSplit
    store: ChunkStore | None
    fast_chunk_bytes: int
    slow_chunk_bytes: int
    _seqs: dict[int, SequenceEntry]
    _fixed_bytes: int  # per-sequence state of compressed + reserved sequences
    _reserved_pages: int  # chunk pages promised to reservations, not yet taken

    def _fast_used(self) -> int:
        used = self._fixed_bytes
        for inner in (self.exact, self.sliding):
            if inner is not None:
                used += inner.pages.pool.num_used * inner.page_bytes
        if self.store is not None:
            used += (self.store.pool.num_used + self._reserved_pages) * self.fast_chunk_bytes
        return used

    def memory_usage(self) -> dict[str, int]:
        slow = (self.store.pool.num_used + self._reserved_pages) * self.slow_chunk_bytes if self.store is not None else 0
        # (the inner caches' scratch pages left out, as of their capacities: idle is empty)
        scratch = sum(inner.scratch_pages * inner.page_bytes for inner in (self.exact, self.sliding) if inner is not None)
        return {"fast": self._fast_used() - scratch, "slow": slow}

    def _plan(self, seq_id: int, num_tokens: int) -> tuple[int, int, bool, int]:
        """(fast bytes of inner pages, chunk pages, compress, fixed bytes) the step needs."""
        sizes = self.memory.sizes
        seq = self._seqs.get(seq_id)
        cached = seq.num_tokens if seq is not None else 0
        inner_bytes = 0
        if self.sliding is not None:
            inner_bytes += self.sliding.pages.pages_for_growth(seq_id, num_tokens) * self.sliding.page_bytes
        if seq is not None and seq.compressed is not None:
            state = seq.compressed
            folds = sizes.fold_count(state.window + num_tokens - cached)
            grown = grown_capacity(state.coefficient_capacity, state.num_chunks + folds)
            growth = coefficient_bytes(state.ranks, sizes.config.chunk, grown - state.coefficient_capacity,
                                       sizes.coefficient_element)
            return inner_bytes, folds, False, growth
        if self.exact is None:
            return inner_bytes, 0, False, 0
        inner_bytes += self.exact.pages.pages_for_growth(seq_id, num_tokens) * self.exact.page_bytes
        if num_tokens >= sizes.config.min_context:  # this step may compress (see the module doc)
            chunks = sizes.compressed_chunks(num_tokens)
            return inner_bytes, chunks, True, sizes.fixed_state_bytes(num_tokens, chunks)
        return inner_bytes, 0, False, 0

    def _reserved_bytes(self, reservation: Reservation | None) -> tuple[int, int]:
        if reservation is None:
            return 0, 0
        return reservation.pages * self.fast_chunk_bytes + reservation.fixed_bytes, reservation.pages

    def _fits(self, seq_id: int, num_tokens: int) -> bool:
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.reservation is not None and seq.reservation.target == num_tokens:
            return True
        inner_bytes, chunk_pages, _, fixed = self._plan(seq_id, num_tokens)
        old_bytes, old_pages = self._reserved_bytes(seq.reservation if seq is not None else None)
        needed = inner_bytes + chunk_pages * self.fast_chunk_bytes + fixed
        if self._fast_used() - old_bytes + needed > self.budget_bytes:
            return False
        # Each store holds only its share of the budget (split.py).
        if not all(inner.pages.can_allocate(seq_id, num_tokens) for inner in self._growing(seq)):
            return False
        old_fixed = seq.reservation.fixed_bytes if seq is not None and seq.reservation is not None else 0
        if self._fixed_bytes - old_fixed + fixed > self.split.fixed:
            return False
        if chunk_pages == 0:
            return True
        free = self.store.pool.num_free - self._reserved_pages + old_pages if self.store is not None else 0
        return chunk_pages <= free

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        if not self._fits(seq_id, num_tokens):
            return False
        seq = self._seqs.setdefault(seq_id, SequenceEntry())
        if seq.reservation is not None and seq.reservation.target == num_tokens:
            return True
        _, chunk_pages, compress, fixed = self._plan(seq_id, num_tokens)
        self._release_reservation(seq)
        for inner in self._growing(seq):
            grown = inner.allocate(seq_id, num_tokens)
            assert grown, "checked by _fits"
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
