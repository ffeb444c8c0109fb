"""The chat workload of `kvforge bench serve --workload chat`: one client holding a
conversation over a document, as a chat client does, against any OpenAI-compatible server.

A conversation is a contiguous window of held-out text cut into the document
(`--shared-prefix` tokens), then per turn a question (`--question-len` tokens) and a reply
(`--output-len` tokens). Turn k's prompt is everything up to and including question k: the
document and the whole history, re-sent each turn, so a server with prefix caching
computes only the new question and the previous reply. The history's replies are the
held-out text, not what the server answered, so every system is sent exactly the same
token ids; each turn still generates `--output-len` tokens (ignore_eos). Turns are sent one
after another, each when the previous one has ended. Every repeat holds a conversation over
a different document (a seeded offset), so no repeat finds another's prefix cached.

Reported per repeat and as the median over repeats: the first turn's TTFT (the document's
prefill) and the mean TTFT of turns 2..N (the prefix-cache hits).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvforge.errors import require
from kvforge.tools.bench.serve_client import RequestRecord, send_one


@dataclass(frozen=True)
class ChatShape:
    document: int
    turns: int
    question: int
    reply: int

    def __post_init__(self) -> None:
        require(self.turns >= 2, "turns", self.turns, "must be >= 2 (turn 1 fills the cache, later turns hit it)")
        for name in ("document", "question", "reply"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1 token")

    @property
    def longest_prompt(self) -> int:
        return self.document + self.turns * self.question + (self.turns - 1) * self.reply

    def turn_prompts(self, window: list[int]) -> list[list[int]]:
        """The prompt of each turn: the window up to the end of that turn's question."""
        return [window[:self.document + turn * (self.question + self.reply) + self.question]
                for turn in range(self.turns)]


def conversations(ids: list[int], shape: ChatShape, count: int, seed: int) -> list[list[list[int]]]:
    """`count` conversations (each a list of turn prompts) at seeded offsets of `ids`."""
    span = shape.longest_prompt
    require(len(ids) > span, "shared_prefix", shape.document,
            f"the conversation needs {span} tokens of held-out text, which has {len(ids)}")
    rng = random.Random(f"chat:{seed}")
    return [shape.turn_prompts(ids[start:start + span]) for start in (rng.randrange(len(ids) - span)
                                                                       for _ in range(count))]


async def run_conversation(base_url: str, bodies: list[dict[str, Any]], timeout: float,
                           headers: dict[str, str] | None) -> list[RequestRecord]:
    """Send each turn's body after the previous turn has ended."""
    records = []
    async with httpx.AsyncClient(base_url=base_url, headers=headers) as client:
        start = time.perf_counter()
        for index, body in enumerate(bodies):
            record = RequestRecord(index, time.perf_counter() - start)
            await send_one(client, body, record, start, timeout)
            records.append(record)
    return records


def summarize_conversation(records: list[RequestRecord]) -> dict[str, Any]:
    ttfts = [r.ttft_s * 1e3 if r.ok and r.ttft_s is not None else None for r in records]
    later = [t for t in ttfts[1:] if t is not None]
    return {"turn_ttft_ms": ttfts, "first_turn_ttft_ms": ttfts[0],
            "later_turns_mean_ttft_ms": statistics.fmean(later) if len(later) == len(ttfts) - 1 else None,
            "failed": sum(not r.ok for r in records),
            "errors": sorted({r.error for r in records if r.error})[:5]}


def median_over(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [run[key] for run in runs if run[key] is not None]
    return statistics.median(values) if len(values) == len(runs) and values else None
