"""A fixed pool of equally sized storage blocks, handed out by integer id, with reference
counts and a cache of freed blocks that still hold a known prefix.

Pure Python, no torch: the cache method owns the tensors, the pool only decides which
block ids are free. A block's life cycle (prefix caching):

    free --allocate--> in use (refs >= 1, more by share) --free (refs -> 0)--> free, or
    cached if registered under a key --share--> in use again;  cached --evicted by allocate--> in use
    by someone else (its key forgotten)

- A block in use has refs >= 1; `share` adds a reference, `free` removes one.
- A registered block whose last reference goes stays cached (LRU order), still findable
  by its key, and is handed out again by `allocate` only when the free list is empty,
  oldest first. So cached blocks never block an allocation, and the pool (the budget)
  bounds everything.
- Allocation is all-or-nothing so a failed request leaves no trace.
- Free blocks are handed out lowest id first (a heap), so a sequence's blocks form ascending
  runs of adjacent storage wherever the free blocks allow. The CPU decode kernels read a
  sequence's pages in order, and adjacent ascending pages stream faster than scattered or
  descending ones (the hardware prefetcher follows them;
  docs/benchmarks.md#measurements-behind-design-choices): a LIFO free list handed the second
  run of a benchmark, or a server's later requests, their pages in descending order.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable

from kvforge.errors import CacheCapacityError, ConfigError


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ConfigError("num_blocks", num_blocks, "the pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest id first

        self._refs = [0] * num_blocks
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; oldest first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now: free plus cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def can_allocate(self, count: int) -> bool:
        return 0 <= count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks (free ones first, then the oldest cached ones, whose keys are
        forgotten); raises CacheCapacityError (taking none) if too few are available."""
        if count < 0:
            raise ConfigError("count", count, "must be >= 0")
        if count > self.num_free:
            raise CacheCapacityError(
                f"block pool exhausted: asked for {count} blocks, {self.num_free} of "
                f"{self.num_blocks} free"
            )
        taken = []
        for _ in range(count):
            if self._free:
                block = heapq.heappop(self._free)
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                self.evictions += 1
            self._refs[block] = 1
            taken.append(block)
        return taken

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; freeing a block that is not in use is a bug and
        raises (before anything changes)."""
        for block in blocks:
            if not (0 <= block < self.num_blocks) or self._refs[block] < 1:
                raise ValueError(f"block {block} is not allocated (double free or foreign id)")
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None  # newest at the end
                else:
                    heapq.heappush(self._free, block)

    # -- prefix caching -------------------------------------------------------------------
    def register(self, block: int, key: Hashable) -> None:
        """Make an in-use block findable under `key` (its content is final). A key already
        held by another block keeps that block; a block keeps its first key."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not allocated: only blocks in use can be registered")
        if key in self._block_of or block in self._key_of:
            return
        self._block_of[key] = block
        self._key_of[block] = key

    def forget_cached(self) -> None:
        """Return every cached (unreferenced) block to the free list, forgetting its key;
        blocks in use keep theirs."""
        for block in self._cached:
            del self._block_of[self._key_of.pop(block)]
            heapq.heappush(self._free, block)
        self._cached.clear()

    def lookup(self, key: Hashable) -> int | None:
        return self._block_of.get(key)

    def share(self, block: int) -> None:
        """Add a reference to a block in use (a fork of a sequence shares its pages) or to a
        cached one (a prefix hit); a free block holds nothing to share."""
        if self._refs[block] == 0 and block not in self._key_of:
            raise ValueError(f"block {block} is free: only blocks in use or cached can be shared")
        if self._refs[block] == 0:
            del self._cached[block]
        self._refs[block] += 1
