"""Per-sequence page tables over a shared block pool, for layers grouped by attention kind.

A *page* is `block_size` tokens of K and V for every cache layer of one *layer group*.
Layers are grouped so that every group has the same number of layers (the gcd of the
number of layers of each kind), which makes all pages the same size and lets one pool
serve global and sliding-window layers without splitting the budget (Gemma3: 3 global +
15 sliding layers -> 6 groups of 3).

Each sequence owns one page list per group. Logical page `j` holds tokens
[j * block_size, (j + 1) * block_size). Sliding-window groups keep only the pages that a
future query can still see and mark released entries with -1.

Pure Python, no torch.

Invariants:
- `allocate(seq, n)` prepares storage for the step that brings `seq` to `n` tokens and is
  all-or-nothing;
- after `commit(seq, n)`, a sliding group with window w holds exactly the pages that
  contain tokens [max(0, n - w + 1), n): the keys any later query can attend to;
- tokens of a sliding group that no later query can see are never stored.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvforge.cache.block_pool import BlockPool
from kvforge.cache.layout import CacheLayout
from kvforge.errors import CacheCapacityError

RELEASED = -1


@dataclass(frozen=True)
class LayerGroups:
    group_size: int
    layers: tuple[tuple[int, ...], ...]  # cache layers of each group, in order
    windows: tuple[int | None, ...]  # sliding window of each group (None = global)
    slot_of: tuple[tuple[int, int], ...]  # cache layer -> (group, index within group)

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @classmethod
    def from_layout(cls, layout: CacheLayout) -> LayerGroups:
        by_window: dict[int | None, list[int]] = {}
        for layer, spec in enumerate(layout.specs):
            by_window.setdefault(spec.sliding_window, []).append(layer)
        size = math.gcd(*(len(layers) for layers in by_window.values()))
        groups: list[tuple[int, ...]] = []
        windows: list[int | None] = []
        for window, layers in by_window.items():
            for start in range(0, len(layers), size):
                groups.append(tuple(layers[start:start + size]))
                windows.append(window)
        slot_of = [(0, 0)] * layout.num_cache_layers
        for group, layers in enumerate(groups):
            for index, layer in enumerate(layers):
                slot_of[layer] = (group, index)
        return cls(size, tuple(groups), tuple(windows), tuple(slot_of))

    def max_pages_per_sequence(self, block_size: int, num_tokens: int) -> int:
        """Pages of `block_size` tokens one sequence of `num_tokens` tokens holds at most
        (steady state + one page of slack per sliding group for the partially filled page)."""
        total = 0
        for window in self.windows:
            kept = num_tokens if window is None else min(num_tokens, window - 1)
            total += math.ceil(kept / block_size) + (0 if window is None else 1)
        return total

    def max_pages_during_step(self, block_size: int, num_tokens: int) -> int:
        """Pages one sequence holds at most while a step brings it to `num_tokens` tokens: a
        sliding group still holds the pages of its previous window (released at `commit`)
        beside those of the new one, each window at most ceil((w - 1) / block) + 1 pages."""
        total = 0
        for window in self.windows:
            pages = math.ceil(num_tokens / block_size)
            total += pages if window is None else min(pages, 2 * (math.ceil((window - 1) / block_size) + 1))
        return total


@dataclass
class _SequencePages:
    pages: list[list[int]]  # per group: page id per logical page, RELEASED once dropped
    num_tokens: int = 0  # tokens committed (stored or deliberately dropped by a window)
    published: int = 0  # logical pages offered for prefix reuse so far


class PageTable:
    def __init__(self, pool: BlockPool, block_size: int, groups: LayerGroups) -> None:
        self.pool = pool
        self.block_size = block_size
        self.groups = groups
        self._seqs: dict[int, _SequencePages] = {}

    # -- queries ----------------------------------------------------------------------
    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id: int) -> int:
        seq = self._seqs.get(seq_id)
        return seq.num_tokens if seq else 0

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def first_kept_token(self, group: int, position: int) -> int:
        """First key a query at `position` (or later) can see in this group. After a
        sequence holds n tokens, the next query sits at position n."""
        window = self.groups.windows[group]
        return 0 if window is None else max(0, position - window + 1)

    def pages(self, seq_id: int, group: int) -> list[int]:
        return self._seqs[seq_id].pages[group]

    def pages_for_growth(self, seq_id: int, num_tokens: int) -> int:
        """Pages that `allocate(seq_id, num_tokens)` would take from the pool."""
        seq = self._seqs.get(seq_id)
        return sum(len(self._new_pages(seq, g, num_tokens)) for g in range(self.groups.num_groups))

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.pages_for_growth(seq_id, num_tokens))

    def max_pages_per_sequence(self, num_tokens: int) -> int:
        return self.groups.max_pages_per_sequence(self.block_size, num_tokens)

    def max_pages_during_step(self, num_tokens: int) -> int:
        return self.groups.max_pages_during_step(self.block_size, num_tokens)

    # -- lifecycle --------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Make room for the step that brings `seq_id` to `num_tokens` tokens.
        Returns False (allocating nothing) if the pool is too small right now."""
        seq = self._seqs.get(seq_id)
        plan = [self._new_pages(seq, g, num_tokens) for g in range(self.groups.num_groups)]
        needed = sum(len(p) for p in plan)
        if not self.pool.can_allocate(needed):
            return False
        if seq is None:
            seq = _SequencePages(pages=[[] for _ in range(self.groups.num_groups)])
            self._seqs[seq_id] = seq
        fresh = iter(self.pool.allocate(needed))
        for group, logical in enumerate(plan):
            table = seq.pages[group]
            wanted = set(logical)
            for index in range(len(table), self._num_logical(num_tokens)):
                table.append(next(fresh) if index in wanted else RELEASED)
        return True

    def commit(self, seq_id: int, num_tokens: int) -> None:
        """Record that `seq_id` now holds `num_tokens` tokens; release pages that fell
        out of every sliding window."""
        seq = self._seqs[seq_id]
        seq.num_tokens = num_tokens
        for group in range(self.groups.num_groups):
            if self.groups.windows[group] is None:
                continue
            first_kept_page = self.first_kept_token(group, num_tokens) // self.block_size
            table = seq.pages[group]
            dropped = [table[j] for j in range(first_kept_page) if table[j] != RELEASED]
            for j in range(first_kept_page):
                table[j] = RELEASED
            self.pool.free(dropped)

    # -- prefix sharing -----------------------------------------------------------------
    def find_prefix(self, keys: Sequence[Hashable], max_pages: int) -> tuple[int, list[list[int]]] | None:
        """The longest run of the first k <= max_pages pages whose content is cached under
        `keys` (key j: page j; a group's own key is (group, keys[j])), as (k, page ids per
        group, RELEASED where a sliding window needs no page), or None. A sliding group needs
        only the pages a query at position k x block_size can still see."""
        pool, groups = self.pool, self.groups
        limit = min(len(keys), max_pages)
        hits = 0  # leading pages cached in every global group
        while hits < limit and all(pool.lookup((g, keys[hits])) is not None
                                   for g in range(groups.num_groups) if groups.windows[g] is None):
            hits += 1
        for k in range(hits, 0, -1):
            tables = []
            for g in range(groups.num_groups):
                first = self.first_kept_token(g, k * self.block_size) // self.block_size
                table = [RELEASED] * first + [pool.lookup((g, keys[j])) for j in range(first, k)]
                if any(page is None for page in table):
                    break
                tables.append(table)
            else:
                return k, tables
        return None

    def attach(self, seq_id: int, num_tokens: int, tables: list[list[int]]) -> None:
        """Start `seq_id` as holding `num_tokens` tokens in cached pages (`find_prefix`'s
        tables); each page gains a reference, so it is freed like the sequence's own."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already holds storage")
        for table in tables:
            for page in table:
                if page != RELEASED:
                    self.pool.share(page)
        pages = len(tables[0]) if tables else 0
        self._seqs[seq_id] = _SequencePages([list(t) for t in tables], num_tokens, published=pages)

    def publish(self, seq_id: int, keys: Sequence[Hashable]) -> None:
        """Register the sequence's full pages not published yet under `keys` (page j under
        (group, keys[j])); only pages every token of which is committed and stored."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        full = min(seq.num_tokens // self.block_size, len(keys))
        # A sliding group stores only what a later query can see: a long chunk skips the
        # tokens that are already out of the window at its end, so a page holds all its
        # tokens only if it lies wholly inside the window now (the window only moves on).
        first_whole = [0 if window is None else -(-self.first_kept_token(g, seq.num_tokens) // self.block_size)
                       for g, window in enumerate(self.groups.windows)]
        for j in range(seq.published, full):
            for g, table in enumerate(seq.pages):
                if j >= first_whole[g] and j < len(table) and table[j] != RELEASED:
                    self.pool.register(table[j], (g, keys[j]))
        seq.published = max(seq.published, full)

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for table in seq.pages:
            self.pool.free([page for page in table if page != RELEASED])

    def require_slots(self, seq_id: int, group: int, start: int, end: int) -> list[int]:
        """Page ids holding tokens [start, end) of a sequence; raises if any is missing."""
        table = self._seqs[seq_id].pages[group] if seq_id in self._seqs else []
        first, last = start // self.block_size, (end - 1) // self.block_size
        if end <= start:
            return []
        if last >= len(table) or any(table[j] == RELEASED for j in range(first, last + 1)):
            raise CacheCapacityError(
                f"sequence {seq_id} has no storage for tokens [{start}, {end}) in layer group "
                f"{group}: call allocate() for the step before running it"
            )
        return table[first:last + 1]

    # -- internals --------------------------------------------------------------------
    def _num_logical(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _new_pages(self, seq: _SequencePages | None, group: int, num_tokens: int) -> list[int]:
        """Logical page indices to allocate so tokens the step stores have a page."""
        have = len(seq.pages[group]) if seq else 0
        first_stored = self.first_kept_token(group, num_tokens) // self.block_size
        return list(range(max(have, first_stored), self._num_logical(num_tokens)))
