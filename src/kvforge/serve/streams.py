"""Async plumbing of the handlers: server-sent events, several request streams merged into
one, and a client that goes away.

Every path that stops listening to a request stream closes it, which aborts the request in
the engine (`AsyncEngine.generate`), so a disconnected client's cache is freed at the next
engine step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from starlette.requests import Request

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


async def last_items(streams: Sequence[AsyncIterator[T]]) -> list[T]:
    """The last item of every stream (the finished request outputs), in stream order."""
    last: dict[int, T] = {}
    async for index, item in merge(streams):
        last[index] = item
    if len(last) != len(streams):
        raise RuntimeError("a request stream ended without any output")
    return [last[index] for index in range(len(streams))]


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
