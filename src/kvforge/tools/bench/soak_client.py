"""The soak's client: sends each `SoakRequest` at its Poisson time (at most `max_in_flight`
open at once), reads streamed and whole answers of both endpoints, leaves a stream after
its `disconnect_after` chunks, and classifies every answer against what was expected.

`bench serve`'s client (serve_client.py) reads one kind of answer, a streamed completion to
its end; the soak also needs chats, whole answers, refusals and leaving mid-stream, so it
sends its own, and records them in `bench serve`'s `RequestRecord` (timings as it defines
them) extended with the status and the outcome.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvforge.tools.bench.serve_client import RequestRecord
from kvforge.tools.bench.soak_traffic import SoakRequest

# "skipped": never sent, its turn came after the traffic's end while the cap on requests in
# flight held it (an overloaded server); every other outcome is of a sent request.
OUTCOMES = ("served", "refused", "disconnected", "server_error", "unexpected", "skipped")


@dataclass
class SoakRecord(RequestRecord):
    kind: str = ""
    expect: str = ""
    status: int | None = None  # HTTP status; None: no answer (transport error)
    disconnected: bool = False  # the client left the stream on purpose
    outcome: str = ""  # one of OUTCOMES


def classify(expect: str, status: int | None, error: str | None, disconnected: bool) -> str:
    """served / refused / disconnected as expected; server_error for any 5xx; unexpected
    for the rest: a bad request answered 200, a good one refused, no answer, an error
    inside a 200 stream, or a stream that ended before the client meant to leave it."""
    if status is not None and status >= 500:
        return "server_error"
    if expect == "refused":
        return "refused" if status is not None and 400 <= status < 500 else "unexpected"
    if status != 200 or error is not None:
        return "unexpected"
    if expect == "disconnect":
        return "disconnected" if disconnected else "unexpected"
    return "served"


def _usage(record: SoakRecord, payload: dict[str, Any]) -> None:
    usage = payload.get("usage") or {}
    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
    record.output_tokens = usage.get("completion_tokens", record.output_tokens)


async def _read_stream(response: httpx.Response, request: SoakRequest, record: SoakRecord, sent: float) -> None:
    chunks = 0
    last = None
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        payload = json.loads(line[6:])
        if "error" in payload:
            record.error = str(payload["error"])[:300]
            return
        _usage(record, payload)
        if not payload.get("choices"):
            continue
        now = time.perf_counter()
        chunks += 1
        if last is None:
            record.ttft_s = now - sent
        else:
            record.itl_s.append(now - last)
        last = now
        if request.disconnect_after and chunks >= request.disconnect_after:
            record.disconnected = True  # leaving the `stream` block closes the connection unread
            return
    if not record.output_tokens:  # no usage chunk: one chunk per token (chat's role chunk aside)
        record.output_tokens = chunks


async def send(client: httpx.AsyncClient, request: SoakRequest, record: SoakRecord, start: float,
               timeout: float) -> None:
    sent = time.perf_counter()
    record.sent_s = sent - start
    try:
        if request.streamed:
            async with client.stream("POST", request.path, json=request.body, timeout=timeout) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    record.error = f"HTTP {response.status_code}: " + (await response.aread()).decode("utf-8", "replace")[:300]
                else:
                    await _read_stream(response, request, record, sent)
        else:
            response = await client.post(request.path, json=request.body, timeout=timeout)
            record.status = response.status_code
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {response.text[:300]}"
            else:
                _usage(record, response.json())
                record.ttft_s = time.perf_counter() - sent  # a whole answer arrives at once
        record.latency_s = time.perf_counter() - sent
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.outcome = classify(request.expect, record.status, record.error, record.disconnected)


@dataclass
class InFlight:
    """Requests the client has sent and not yet seen end (read by the memory sampler)."""

    count: int = 0


async def run_traffic(base_url: str, requests: Sequence[SoakRequest], schedule: Sequence[float], timeout: float,
                      max_in_flight: int, in_flight: InFlight, end_s: float,
                      on_done: Callable[[SoakRecord], None] | None = None) -> list[SoakRecord]:
    """Sends requests[i] at schedule[i] seconds after the start, or as soon after as fewer
    than `max_in_flight` are open, but never after `end_s` (the traffic stays bounded when
    the server falls behind: what is still held then is skipped); returns one record per
    request once all have ended."""
    records = [SoakRecord(r.index, at, kind=r.kind, expect=r.expect) for r, at in zip(requests, schedule)]
    gate = asyncio.Semaphore(max_in_flight)
    limits = httpx.Limits(max_connections=max_in_flight + 4, max_keepalive_connections=max_in_flight + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:
        start = time.perf_counter()

        async def launch(request: SoakRequest, record: SoakRecord) -> None:
            delay = record.scheduled_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                if time.perf_counter() - start >= end_s:
                    record.outcome = "skipped"
                    return
                in_flight.count += 1
                try:
                    await send(client, request, record, start, timeout)
                finally:
                    in_flight.count -= 1
            if on_done is not None:
                on_done(record)

        await asyncio.gather(*(launch(q, r) for q, r in zip(requests, records)))
    return records
