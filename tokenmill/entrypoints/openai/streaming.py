"""Server-sent events, merged engine streams, and cancellation when the client goes away.

Whether streaming or not, a request's work runs in a task that is cancelled as soon as
the client disconnects; cancelling it closes the engine streams, which aborts their
requests in the engine (so their KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
_DONE = object()
DONE_EVENT = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Streams `events` as text/event-stream; stops (closing `events`) when the client
    disconnects, whatever the ASGI server's spec version, and calls `on_close` however
    it ends, even if `events` never started."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            stream = asyncio.ensure_future(self._stream(send))
            watcher = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (stream, watcher):
                    task.cancel()
                await asyncio.gather(stream, watcher, return_exceptions=True)
            if stream.done() and not stream.cancelled() and stream.exception() is not None:
                raise stream.exception()
        finally:
            self.on_close()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        finally:
            await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`; cancels it and raises `ClientGone` when the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with their stream's index.
    Closing the merged stream cancels (and so closes) every source still running."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((i, exc))
            return
        queue.put_nowait((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
