"""Async plumbing of the handlers: server-sent events, several request streams merged into
one, and a client that goes away.

Every path that stops listening to a request stream closes it, which aborts the request in
the engine (`AsyncEngine.generate`), so a disconnected client's cache is freed at the next
engine step.

A request that fails mid-generation (it ends with finish_reason "error": its constraint's
matcher broke, or the KV budget cannot hold it even alone; or the engine step failed) fails
the whole response, as in vLLM. A non-streamed response is then a 500 naming why. A
streamed one has already answered 200 (a stream's status goes out before its first event),
so it ends with an error event and `[DONE]` instead of a cut connection. The request's
other choices are aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from starlette.requests import Request

from kvforge.engine.async_engine import EngineUnavailableError
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.request import FinishReason
from kvforge.errors import KVForgeError
from kvforge.serve.protocol import APIError

logger = logging.getLogger(__name__)
T = TypeVar("T")
DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the response was ready."""


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) from every stream as items arrive. An exception from any stream is
    raised here; leaving early (or failing) closes every stream."""
    if len(streams) == 1:  # the common case needs no tasks
        stream = streams[0]
        try:
            async for item in stream:
                yield 0, item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


def generation_failed(message: str | None) -> APIError:
    """The 500 of a request that ended with finish_reason "error", naming why."""
    return APIError(500, f"the generation failed: {message or 'no reason given'}", error_type="internal_error")


async def outputs(streams: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`merge` of request streams, raising `generation_failed` at the first output that ended
    in error (every stream is then closed: the other choices are aborted)."""
    merged = merge(streams)
    try:
        async for index, out in merged:
            if out.finish_reason == FinishReason.ERROR.value:
                logger.warning("request %s failed: %s", out.request_id, out.error)
                raise generation_failed(out.error)
            yield index, out
    finally:
        await merged.aclose()  # type: ignore[attr-defined]


async def last_items(streams: Sequence[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The last output of every stream (the finished requests), in stream order."""
    last: dict[int, RequestOutput] = {}
    async for index, item in outputs(streams):
        last[index] = item
    if len(last) != len(streams):
        raise RuntimeError("a request stream ended without any output")
    return [last[index] for index in range(len(streams))]


async def ending_with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A response stream's events; if producing them fails (a request ended in error, the
    engine step failed, or a bug), an error event in OpenAI's error schema and `[DONE]`
    end it, as vLLM's streams end, so a client reads why rather than a cut connection."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - reported to the client; a bug is logged too
        yield sse(api_error_of(exc).body())
        yield DONE
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def api_error_of(exc: Exception) -> APIError:
    """What a response reports for a failure, streamed or not: a refusal as it is, an engine
    that stopped as 503, a failed step as 500, and anything else (a bug, logged with its
    traceback) as a 500 naming the exception, as vLLM reports it."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), error_type="service_unavailable")
    if isinstance(exc, KVForgeError):  # the engine step failed
        return APIError(500, str(exc), error_type="internal_error")
    logger.error("a response failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", error_type="internal_error")


async def _until_disconnected(request: Request) -> None:
    # The body was read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, or cancel it (closing its streams) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
