"""Server-sent events, and noticing a client that left.

A client that disconnects must have its engine request aborted at once: its KV blocks are freed
before the engine's next step. Two paths lead there:
- streamed responses (`SSEResponse`) listen for `http.disconnect` while they stream and then
  cancel the body generator, whose `aclosing(engine.generate(...))` aborts the request;
- non-streamed ones run their work under `until_disconnected`, which cancels it the same way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
REQUEST_ID_HEADER = "X-Request-Id"  # the id in the server's log lines, so a client's report can be found
# For the OpenAPI schema of a route that answers JSON, or server-sent events when the body asks to stream.
MAY_STREAM: dict[int | str, dict[str, Any]] = {
    200: {"description": "The answer, or its server-sent events when streamed", "content": {"text/event-stream": {}}}}


def sse_event(payload: dict[str, Any] | str, sep: str = " ") -> str:
    """One event: `data: <json>` (OpenAI) or `data:<json>` (TGI's sep="")."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data:{sep}{data}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that (1) watches for the client leaving whatever ASGI version the
    server speaks (starlette only listens below 2.4, otherwise it notices on the next failed write)
    and (2) always closes its body generator and its source and calls `on_close`, even if the body
    never started (closing an unstarted generator would not reach the stream it wraps)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None,
                 request_id: str | None = None, source: Any = None) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if request_id is not None:
            headers[REQUEST_ID_HEADER] = request_id
        super().__init__(content, headers=headers)
        self._on_close = on_close
        self._source = source  # what `content` reads (has aclose); closed too, as `content` may never have started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client left while we were writing
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()  # the client left: stop streaming
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            if self._source is not None:
                await self._source.aclose()
            if self._on_close is not None:
                self._on_close()


class ClientGone(Exception):
    """The client disconnected before its non-streamed response was ready."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)  # let its cleanup (the abort) run
        raise ClientGone()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive: (which stream, item). An exception in
    one ends the merge with it; closing the merge closes every stream."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except Exception as e:
            await queue.put((i, done, e))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
