"""Exact (full-precision) copies of a sequence's newest vLLM blocks: KIVI's residual in a
paged cache (pure Python; the tensors live in kivi_pages.ExactPool).

kvforge's KIVI keeps, per sequence, a ring of its last R tokens: with n tokens held, keys
of [nk, n) and values of [n - R, n) are read from it (nk = (n // R) * R), everything older
from the quantised pages. vLLM's attention backend sees blocks, not sequences: a block
table row per scheduled request and nothing that outlives a request. So the residual is
kept per *block* instead: an exact copy of a block's tokens, keyed by its block id, in a
pool of `num_slots` copies. A copy is valid as long as its block's content is (vLLM never
rewrites a block's tokens without first writing its offset 0, which re-keys the copy), so
copies are shared correctly between requests that share a prefix block.

Per step (`plan`): every block that becomes full is quantised into its page at once (the
page codes of a token do not depend on when they are written, so this equals kvforge's
flush of R tokens at a time), and the copies of the blocks that hold the last R tokens are
kept. Readers take a token from a copy where kvforge's rule says "residual" and from the
page otherwise; the only block that has no page is a sequence's partly filled last block,
whose copy is therefore pinned. A full block's copy that was evicted (only possible for a
prefix-cache hit on a block its writer left long ago) is read from its page: the one case
where this backend reads a quantised value kvforge's ring would hold exactly.

Eviction: least recently used among the copies the current step does not read or write.
A copy the step needs but that is missing raises (`LostExactCopy`) rather than being read
from garbage.

Sinks (`sinks` = N > 0, N <= G): the first N tokens of a sequence stay exact for good, in the
sink area of the sequence's first block (kivi_pages.SinkArea), which lives as long as the
block does, so a prefix-cache hit on that block finds them (a copy could be evicted). The
plan names the rows that write them and, as kvforge's flush does, quantises the first
block's keys with its sink tokens replaced by token N (the sinks are read from the sink
area, never from the page, so they are left out of the page's per-channel range).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MISSING = -1  # a ring position kvforge reads exactly whose copy is gone: read the page


def exact_slots(block_size: int, residual: int, max_num_seqs: int) -> int:
    """Copies per layer that always suffice: during a step each sequence reads the blocks
    of its last R tokens before the step (at most R / G + 1) and keeps those after it (as
    many; disjoint after a long prefill chunk)."""
    return max_num_seqs * 2 * (residual // block_size + 1)


class LostExactCopy(RuntimeError):
    """A partly filled block's exact copy is not in the pool (it was evicted)."""


@dataclass(frozen=True)
class SequenceStep:
    """One scheduled request: `stored` tokens held before the step, `new` tokens written in
    it at rows [first_row, first_row + new) of the step, `blocks` its block table row."""

    stored: int
    new: int
    first_row: int
    blocks: Sequence[int]


@dataclass
class ExactPlan:
    """What a step does with the copies (indices into `ExactPool` tensors).

    write_rows/slots/offsets: step row -> (copy slot, token offset) for the new tokens kept
    exact. full_blocks: block ids that become full in this step; full_sources: for their
    tokens in order (len(full_blocks) * block_size), an index into the step's source, the
    copies flattened [num_slots * block_size] followed by the step's rows. ring_sources: per
    sequence, R flattened copy indices, position t of the window [n - R, n) at t % R;
    MISSING where the copy is gone (read the page), 0 where nothing is read.
    sink_rows/blocks/tokens: step row -> (first block of its sequence, token index < N) for
    the sink tokens written in the step. key_fill_to/from: positions in the full blocks'
    token list whose key is replaced by another's before quantising (the sinks of a first
    block, by token N)."""

    write_rows: list[int] = field(default_factory=list)
    write_slots: list[int] = field(default_factory=list)
    write_offsets: list[int] = field(default_factory=list)
    full_blocks: list[int] = field(default_factory=list)
    full_sources: list[int] = field(default_factory=list)
    ring_sources: list[list[int]] = field(default_factory=list)
    sink_rows: list[int] = field(default_factory=list)
    sink_blocks: list[int] = field(default_factory=list)
    sink_tokens: list[int] = field(default_factory=list)
    key_fill_to: list[int] = field(default_factory=list)
    key_fill_from: list[int] = field(default_factory=list)

    @property
    def any_missing(self) -> bool:
        return any(MISSING in ring for ring in self.ring_sources)


class ExactCopies:
    """Which pool slot holds the exact copy of which block (the tensors are elsewhere)."""

    def __init__(self, num_slots: int, block_size: int, residual: int, sinks: int = 0) -> None:
        if num_slots < 1 or block_size < 1 or residual < block_size or residual % block_size:
            raise ValueError(f"need num_slots >= 1 and residual a multiple of block_size >= 1, got "
                             f"num_slots={num_slots}, block_size={block_size}, residual={residual}")
        if not 0 <= sinks <= block_size:
            raise ValueError(f"need 0 <= sinks <= block_size (the sinks live in a sequence's first block), "
                             f"got sinks={sinks}, block_size={block_size}")
        self.num_slots, self.block_size, self.residual, self.sinks = num_slots, block_size, residual, sinks
        self.slot_of: dict[int, int] = {}
        self.block_in: list[int | None] = [None] * num_slots
        self.last_used = [0] * num_slots
        self.step = 0

    def blocks_for_window(self, start: int, end: int) -> range:
        """Block indices (within a row) holding tokens [start, end)."""
        if end <= start:
            return range(0)
        return range(start // self.block_size, (end - 1) // self.block_size + 1)

    def _touch(self, slot: int) -> None:
        self.last_used[slot] = self.step

    def _take_slot(self, block: int) -> int:
        """A slot for `block`'s copy: its own if it has one, else a free one, else the least
        recently used one no sequence of this step touches."""
        slot = self.slot_of.get(block)
        if slot is None:
            candidates = [s for s in range(self.num_slots) if self.block_in[s] is None]
            if not candidates:
                candidates = [s for s in range(self.num_slots) if self.last_used[s] < self.step]
            if not candidates:
                raise LostExactCopy(f"all {self.num_slots} exact block copies are in use by this step; "
                                    f"more sequences ran than exact_slots() was sized for")
            slot = min(candidates, key=lambda s: self.last_used[s])
            old = self.block_in[slot]
            if old is not None:
                del self.slot_of[old]
            self.block_in[slot] = block
            self.slot_of[block] = slot
        self._touch(slot)
        return slot

    def plan(self, sequences: Sequence[SequenceStep]) -> ExactPlan:
        g, r = self.block_size, self.residual
        self.step += 1
        plan = ExactPlan()
        # 1. Pin what the step reads: the copies of each sequence's window before the step.
        for seq in sequences:
            n = seq.stored
            for k in self.blocks_for_window(max(0, n - r), n):
                slot = self.slot_of.get(seq.blocks[k])
                if slot is not None:
                    self._touch(slot)
                elif (k + 1) * g > n:
                    raise LostExactCopy(f"the exact copy of block {seq.blocks[k]} (tokens {k * g}.. of a sequence "
                                        f"holding {n}) is gone; its keys exist nowhere else")
        # 2. Copies for the blocks that hold the last R tokens after the step and get new
        # tokens in it (a block first written at offset 0 takes over any stale copy of its id).
        keep: dict[int, int] = {}  # block id -> slot
        for seq in sequences:
            end = seq.stored + seq.new
            for k in self.blocks_for_window(max(seq.stored, end - r), end):
                keep[seq.blocks[k]] = self._take_slot(seq.blocks[k])
        pool_tokens = self.num_slots * g
        for seq in sequences:
            n, end = seq.stored, seq.stored + seq.new
            for t in range(n, end):
                slot = keep.get(seq.blocks[t // g])
                if slot is not None:
                    plan.write_rows.append(seq.first_row + t - n)
                    plan.write_slots.append(slot)
                    plan.write_offsets.append(t % g)
            for t in range(n, min(end, self.sinks)):
                plan.sink_rows.append(seq.first_row + t - n)
                plan.sink_blocks.append(seq.blocks[0])
                plan.sink_tokens.append(t)
            # 3. Blocks completed in this step: old tokens from the copy, new ones from the rows.
            for k in range(n // g, end // g):
                plan.full_blocks.append(seq.blocks[k])
                if k == 0 and 0 < self.sinks < g:  # as kvforge's flush: sinks out of the keys' range
                    first = len(plan.full_sources)
                    plan.key_fill_to.extend(range(first, first + self.sinks))
                    plan.key_fill_from.extend([first + self.sinks] * self.sinks)
                for t in range(k * g, (k + 1) * g):
                    plan.full_sources.append(self.slot_of[seq.blocks[k]] * g + t % g if t < n
                                             else pool_tokens + seq.first_row + t - n)
            # 4. The ring kvforge would hold before the step: tokens [n - R, n) at t % R.
            ring = [0] * r
            for t in range(max(0, n - r), n):
                slot = self.slot_of.get(seq.blocks[t // g])
                ring[t % r] = MISSING if slot is None else slot * g + t % g
            plan.ring_sources.append(ring)
        return plan
