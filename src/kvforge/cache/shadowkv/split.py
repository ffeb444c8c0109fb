"""One split of ShadowKV's fast-tier budget between its stores.

Device memory is the budget: on CUDA every `torch.empty` costs its whole size at once, so the
stores cannot each be sized from the whole budget (the inner exact cache, the sliding inner
cache and the chunk pages would together ask for up to 2.3x the budget). The budget is split
once, at construction, into the parts of one reference sequence at the step that compresses
it (the terms of its `sequence_bytes`):
  exact   the inner `full` cache of the global layers (sequences not compressed yet),
  sliding the inner `full` cache of the sliding-window layers,
  chunks  the chunk pages' fast part (coefficients, landmarks),
  fixed   the per-sequence state of compressed sequences (bases, exact buffers, ids),
          allocated when a sequence is compressed, never up front.
The reference is `split_context` tokens, the budget then split in those proportions; or by
default the longest sequence the budget holds alone (after one chunk page set aside), so a
lone sequence fits exactly when its `sequence_bytes` does, as before the split. Each share
is a hard bound that `allocate` checks, so together (the budget) they bound the device bytes.
Outside the budget stay only a compressed sequence's page table (8 bytes per chunk, next to
the chunk's hundreds to thousands of fast bytes) and per-step workspace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvforge.errors import ConfigError

PARTS = ("exact", "sliding", "chunks", "fixed")


@dataclass(frozen=True)
class BudgetSplit:
    exact: int  # bytes
    sliding: int  # bytes
    chunk_pages: int  # pages of `fast_chunk_bytes`
    fixed: int  # bytes

    @classmethod
    def of(cls, budget: int, parts: Callable[[int], dict[str, int]], reference: int | None,
           fast_chunk_bytes: int) -> BudgetSplit:
        """`parts(n)`: bytes of each of PARTS that one sequence of n tokens holds at most
        (`parts(1)`: the least a store in use must hold)."""
        if reference is None:
            room = budget - fast_chunk_bytes  # compression needs at least one chunk page
            lo, hi = 0, max(1, room)  # the longest n with sum(parts(n)) <= room: sums only grow with n
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if sum(parts(mid).values()) <= room else (lo, mid - 1)
            if lo == 0:
                raise ConfigError("kv_budget", budget, "must hold one token of one sequence plus one compressed "
                                                       f"chunk ({fast_chunk_bytes} bytes)")
            shares = parts(lo)
            shares["chunks"] += fast_chunk_bytes
        else:
            wanted = parts(reference)
            total = sum(wanted.values())
            shares = {name: budget * wanted[name] // total for name in PARTS}
            least = {**parts(1), "chunks": fast_chunk_bytes, "fixed": 0}
            for name in PARTS:
                if shares[name] < least[name]:
                    raise ConfigError("kv_budget", budget,
                                      f"must give the {name} store {least[name]} bytes in its split by "
                                      f"split_context={reference}: at least "
                                      f"{-(-least[name] * total // wanted[name])} bytes")
        pages = shares["chunks"] // fast_chunk_bytes
        # What rounding leaves goes to the per-sequence state.
        return cls(shares["exact"], shares["sliding"], pages,
                   budget - shares["exact"] - shares["sliding"] - pages * fast_chunk_bytes)
