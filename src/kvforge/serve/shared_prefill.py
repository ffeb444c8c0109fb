"""The n completions of one prompt (OpenAI's `n`) computing that prompt once.

Each completion is its own engine request. Submitted together, they are scheduled into the
same steps, before any of them has published the prompt's pages to the prefix cache, so
each computes the whole prompt: n = 4 on a 1,900-token prompt took twice the time of n = 1
on smollm2-135m (docs/benchmarks.md#kvforgeserve). With prefix caching on, the first
completion of each prompt leads: the others are submitted once it has produced its first
token, when its prompt is in the prefix cache, and they start from there. The leader
failing or being closed opens the gate too; a follower closed before the gate opens was
never submitted, so there is nothing to abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


class FirstOutputGate:
    """Holds follower streams back until the leader stream has produced an output (or ended)."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def lead(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        try:
            async for item in stream:
                self.opened.set()
                yield item
        finally:
            self.opened.set()
            await stream.aclose()  # type: ignore[attr-defined]

    async def follow(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        try:
            await self.opened.wait()
            async for item in stream:
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]


def after_first_sample(streams: Sequence[AsyncIterator[T]], samples: Sequence[int],
                       prefix_caching: bool) -> list[AsyncIterator[T]]:
    """`streams` (stream i is sample `samples[i]` of its prompt; a prompt's sample 0 comes
    before its others) with each prompt's later samples held until its sample 0 has
    produced a token. Unchanged without prefix caching (nothing would be shared) or n = 1."""
    if not prefix_caching or all(sample == 0 for sample in samples):
        return list(streams)
    gated: list[AsyncIterator[T]] = []
    gate = FirstOutputGate()
    for stream, sample in zip(streams, samples):
        if sample == 0:
            gate = FirstOutputGate()
            gated.append(gate.lead(stream))
        else:
            gated.append(gate.follow(stream))
    return gated
