"""A fixed pool of equally sized storage blocks, handed out by integer id.

Pure Python, no torch: the cache method owns the tensors, the pool only decides which
block ids are free. Allocation is all-or-nothing so a failed request leaves no trace.
"""

from __future__ import annotations

from kvforge.errors import CacheCapacityError, ConfigError


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ConfigError("num_blocks", num_blocks, "the pool needs at least one block")
        self.num_blocks = num_blocks
        # LIFO free list: recently freed blocks are reused first (warm in caches).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._in_use = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, count: int) -> bool:
        return 0 <= count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks; raises CacheCapacityError (taking none) if too few are free."""
        if count < 0:
            raise ConfigError("count", count, "must be >= 0")
        if count > len(self._free):
            raise CacheCapacityError(
                f"block pool exhausted: asked for {count} blocks, {len(self._free)} of "
                f"{self.num_blocks} free"
            )
        taken = [self._free.pop() for _ in range(count)]
        for block in taken:
            self._in_use[block] = True
        return taken

    def free(self, blocks: list[int]) -> None:
        """Return blocks; freeing a block that is not in use is a bug and raises."""
        for block in blocks:
            if not (0 <= block < self.num_blocks) or not self._in_use[block]:
                raise ValueError(f"block {block} is not allocated (double free or foreign id)")
        for block in blocks:
            self._in_use[block] = False
            self._free.append(block)
