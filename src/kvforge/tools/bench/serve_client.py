"""The load client of `kvforge bench serve`: requests sent on a fixed arrival schedule to
any OpenAI-compatible server, each timed from its send to every streamed chunk.

One request: `POST /v1/completions` with `stream: true` and `stream_options.include_usage`
(the usage chunk gives the server's own token counts), `max_tokens = min_tokens =
output_len` and `ignore_eos` so every system produces the same number of tokens.
Measured on the client's clock: TTFT (send -> first chunk carrying a token), ITL (gaps
between later chunks), end-to-end latency, and TPOT = (latency - TTFT) / (tokens - 1).

Bounded: every request has a timeout, the schedule has a fixed count, and the run ends
when the last request ends. Loopback or the user's own server only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass
class RequestRecord:
    index: int
    scheduled_s: float  # planned send time, seconds from the start of the run
    sent_s: float = 0.0  # actual send time, same clock
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def poisson_schedule(count: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds) of `count` requests arriving as a Poisson process of `rate`
    per second (exponential gaps, first request at 0); all at 0 for an infinite rate.
    The same (count, rate, seed) gives the same schedule for every system."""
    import random

    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(f"{seed}:{rate}")
    times, now = [], 0.0
    for index in range(count):
        if index:
            now += rng.expovariate(rate)
        times.append(now)
    return times


async def send_one(client: httpx.AsyncClient, body: dict[str, Any], record: RequestRecord, start: float,
               timeout: float) -> None:
    sent = time.perf_counter()
    record.sent_s = sent - start
    last = None
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    record.error = str(payload["error"])[:300]
                    return
                if payload.get("usage"):
                    record.prompt_tokens = payload["usage"].get("prompt_tokens", 0)
                    record.output_tokens = payload["usage"].get("completion_tokens", 0)
                if not payload.get("choices"):
                    continue
                now = time.perf_counter()
                chunks += 1
                if last is None:
                    record.ttft_s = now - sent
                else:
                    record.itl_s.append(now - last)
                last = now
        record.latency_s = time.perf_counter() - sent
        if not record.output_tokens:  # a server without usage chunks: one chunk per token
            record.output_tokens = chunks
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]


async def run_schedule(base_url: str, bodies: Sequence[dict[str, Any]], schedule: Sequence[float],
                       timeout: float, on_done: Callable[[RequestRecord], None] | None = None,
                       headers: dict[str, str] | None = None) -> tuple[list[RequestRecord], float]:
    """Send bodies[i] at schedule[i] seconds after the start; returns the records and the
    wall seconds from the start until the last request ended."""
    records = [RequestRecord(i, at) for i, at in enumerate(schedule)]
    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, headers=headers) as client:
        start = time.perf_counter()

        async def launch(record: RequestRecord, body: dict[str, Any]) -> None:
            delay = record.scheduled_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            await send_one(client, body, record, start, timeout)
            if on_done is not None:
                on_done(record)

        await asyncio.gather(*(launch(r, b) for r, b in zip(records, bodies)))
        return records, time.perf_counter() - start
