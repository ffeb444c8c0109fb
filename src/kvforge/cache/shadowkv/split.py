"""One split of ShadowKV's fast-tier budget between its stores.

Device memory is the budget: on CUDA every `torch.empty` costs its whole size at once, so the
stores cannot each be sized from the whole budget (the inner exact cache, the sliding inner
cache and the chunk pages would together ask for up to 2.3x the budget). The budget is split
once, at construction, between the terms of a sequence's `sequence_bytes` (what it holds at
the step that compresses it):
  exact   the inner `full` cache of the global layers (sequences not compressed yet),
  sliding the inner `full` cache of the sliding-window layers,
  chunks  the chunk pages' fast part (landmarks, candidate flags),
  fixed   the per-sequence state of compressed sequences (bases, key coefficients, exact
          buffers, ids),
          allocated when a sequence is compressed, never up front.
After one chunk page is set aside (compression needs one), the budget is split by default in
two halves: one holds the parts of the longest sequence that fits in it alone (long prompts,
and requests recomputed from scratch after a preemption, up to half the budget's bytes, and no
longer than the longest a sequence may be, `CacheLayout.max_sequence_tokens`: room for a
longer one would never be used), the other the parts of min_context-token sequences (the
shortest that compress): the exact stores and the compressed state (chunk pages + per-sequence
state) in their proportions, and the compressed state between chunk pages and per-sequence
state in the ratio of what one more token costs each (`_per_token_mix`). A min_context
sequence's per-sequence state is mostly its fixed-size buffers, so its own proportions would
give the chunk pages so few that longer compressed sequences ran out of pages with most of the
state's share unused (docs/benchmarks.md#measurements-behind-design-choices); by the per-token
ratio the pages run out only once the state's share is used too (at the largest rank, which
compression never exceeds). If the budget cannot hold even one min_context sequence, or no
sequence may be that long, nothing ever compresses and the whole budget goes to the exact
stores (in the proportions of the longest sequence). With `split_context` the whole budget is
split in the proportions of a sequence of that many tokens instead. With `exact_share` the
exact store gets that fraction of the budget and what every decoding sequence holds (the
sliding windows, chunk pages and per-sequence state) the rest, in the proportions above: for
serving many long compressed sequences, whose exact pages are freed when they compress, so
that at most the prompts being prefilled hold exact pages at once (the proportions of one
sequence at its compression step give the exact store most of a large budget: 75% of 60 GiB at
Llama-3.1-8B's shapes). Each share is a hard bound that `allocate` checks, so together (the
budget) they bound the device bytes.
Outside the budget stay only a compressed sequence's page table (8 bytes per chunk, next to
the chunk's hundreds to thousands of fast bytes) and per-step workspace.
"""

from __future__ import annotations

import math
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
    def of(cls, budget: int, parts: Callable[[int], dict[str, int]], reference: int | None, min_context: int,
           fast_chunk_bytes: int, exact_share: float | None = None, max_tokens: int | None = None) -> BudgetSplit:
        """`parts(n)`: bytes of each of PARTS that one sequence of n tokens holds at most
        (`parts(1)`: the least a store in use must hold). `max_tokens`: no sequence is longer."""
        room = max(0, budget - fast_chunk_bytes)
        bound = max_tokens if max_tokens is not None else room  # (room >= any n whose parts fit)
        if exact_share is not None:
            shares = _by_exact_share(budget, room, parts, reference, min_context, fast_chunk_bytes, exact_share)
        elif reference is None:
            longest = _longest(parts, room)
            if longest == 0:
                raise ConfigError("kv_budget", budget, "must hold one token of one sequence plus one compressed "
                                                       f"chunk ({fast_chunk_bytes} bytes)")
            if min(longest, bound) < min_context:  # nothing ever compresses: all of it for the exact stores
                shares = _proportional(room, parts(min(longest, bound)))
            else:
                lone = parts(min(_longest(parts, room // 2), bound))
                shares = _add(lone, _proportional(room - sum(lone.values()), _per_token_mix(parts, min_context)))
        else:
            wanted = parts(reference)
            shares = _proportional(room, wanted)
            total = sum(wanted.values())
            _check_least(shares, parts, budget, f"split_context={reference}",
                         lambda name: -(-parts(1)[name] * total // wanted[name]) + fast_chunk_bytes)
        pages = shares["chunks"] // fast_chunk_bytes + 1  # with the page set aside
        # What rounding leaves goes to the per-sequence state.
        return cls(shares["exact"], shares["sliding"], pages,
                   budget - shares["exact"] - shares["sliding"] - pages * fast_chunk_bytes)


def _by_exact_share(budget: int, room: int, parts: Callable[[int], dict[str, int]], reference: int | None,
                    min_context: int, fast_chunk_bytes: int, exact_share: float) -> dict[str, int]:
    """exact_share of `room` for the exact store, the rest in `reference`'s proportions (or
    the per-token mix at min_context) for what decoding sequences hold."""
    wanted = parts(reference) if reference is not None else _per_token_mix(parts, min_context)
    exact_room = int(room * exact_share)
    shares = {**_proportional(room - exact_room, {**wanted, "exact": 0}), "exact": exact_room}
    rest = wanted["sliding"] + wanted["chunks"] + wanted["fixed"]
    _check_least(shares, parts, budget, f"exact_share={exact_share}",
                 lambda name: fast_chunk_bytes + math.ceil(
                     parts(1)[name] / exact_share if name == "exact"
                     else parts(1)[name] * rest / wanted[name] / (1 - exact_share)))
    compressed = parts(min_context)
    if shares["chunks"] < compressed["chunks"] or shares["fixed"] < compressed["fixed"]:
        raise ConfigError("kv_budget", budget, f"must leave one compressed min_context={min_context} sequence "
                                               f"{compressed['chunks'] + compressed['fixed']} bytes of chunk pages "
                                               f"and state beside exact_share={exact_share}")
    return shares


def _check_least(shares: dict[str, int], parts: Callable[[int], dict[str, int]], budget: int, rule: str,
                 budget_needed: Callable[[str], int]) -> None:
    """Each exact store in use gets at least one token of one sequence in its share."""
    least = parts(1)
    for name in ("exact", "sliding"):
        if shares[name] < least[name]:
            raise ConfigError("kv_budget", budget, f"must give the {name} store {least[name]} bytes in its split by "
                                                   f"{rule}: at least {budget_needed(name)} bytes")


def _longest(parts: Callable[[int], dict[str, int]], room: int) -> int:
    """The longest n whose parts add up to at most `room` (0: none); sums only grow with n."""
    lo, hi = 0, room
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(parts(mid).values()) <= room else (lo, mid - 1)
    return lo


def _per_token_mix(parts: Callable[[int], dict[str, int]], n: int) -> dict[str, int]:
    """parts(n) with its compressed bytes (chunks + fixed) divided between the two in the
    ratio of their per-token rates, parts(2n) - parts(n): the fixed-size part of the
    per-sequence state (bases, exact buffers) needs no chunk pages."""
    at, twice = parts(n), parts(2 * n)
    chunk_rate, fixed_rate = twice["chunks"] - at["chunks"], twice["fixed"] - at["fixed"]
    compressed = at["chunks"] + at["fixed"]
    chunks = compressed * chunk_rate // (chunk_rate + fixed_rate) if chunk_rate + fixed_rate > 0 else at["chunks"]
    return {**at, "chunks": chunks, "fixed": compressed - chunks}


def _proportional(budget: int, wanted: dict[str, int]) -> dict[str, int]:
    total = sum(wanted.values())
    return {name: budget * wanted[name] // total for name in PARTS}


def _add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {name: a[name] + b[name] for name in PARTS}
