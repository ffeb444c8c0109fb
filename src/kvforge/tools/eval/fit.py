"""Fitting a generated prompt to a token budget with the model's own tokenizer.

Token counts are not additive over haystack units (sentences, words, needles), but they
grow with the number of units. `largest_fitting` finds the largest unit count whose
encoded prompt stays within the budget: a linear probe from an estimate, then bisection.
"""

from __future__ import annotations

from collections.abc import Callable

from kvforge.errors import require


def largest_fitting(encode: Callable[[int], list[int]], budget: int, tokens_per_unit: float,
                    what: str = "length") -> tuple[int, list[int]]:
    """(count, token ids) for the largest `count` with len(encode(count)) <= budget."""
    cache: dict[int, list[int]] = {}

    def ids(count: int) -> list[int]:
        if count not in cache:
            cache[count] = encode(count)
        return cache[count]

    bare = len(ids(0))
    require(bare <= budget, what, budget, f"must hold the prompt without any filler ({bare} tokens)")
    guess = max(0, int((budget - bare) / max(tokens_per_unit, 1e-6)))
    step = max(1, guess // 32)
    low, high = 0, max(1, guess)  # ids(low) fits; high is a candidate
    while len(ids(high)) <= budget:
        low, high = high, high + step
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if len(ids(middle)) <= budget else (low, middle)
    return low, ids(low)
