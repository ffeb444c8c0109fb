"""Stop strings in a request's output text: where one starts, and how much of the text's end
may still become one (a stream holds that back: a delta never shows text the final output
will not have)."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop_match(text: str, stops: Sequence[str], search_from: int) -> tuple[int, str] | None:
    """(index in `text` where the earliest stop string starts, that stop string), or None;
    of two starting at one index, the first in `stops`.

    `text[:search_from]` was searched before (it held no stop string), so only matches
    that end after `search_from` are looked for: each stop s is searched from
    `search_from - len(s) + 1`, which keeps incremental decoding O(new text).
    Empty stop strings are ignored.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        found = text.find(stop, max(0, search_from - len(stop) + 1))
        if found >= 0 and (best is None or found < best[0]):
            best = (found, stop)
    return best


def pending_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string:
    the text a stop string may still claim when more text follows. A stream holds it back
    (a delta never shows text the final output will not have)."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
