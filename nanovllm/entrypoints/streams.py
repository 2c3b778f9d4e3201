"""The lifetimes of engine requests under an HTTP request: they run together, their outputs merged as
they come; they end together, and early when the client leaves or the server shuts down (an engine
request left early is aborted, which frees its KV blocks)."""
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

T = TypeVar("T")
_ITEM, _DONE, _ERROR = range(3)


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index of its stream, item) as the streams yield them, all running at once. A stream's exception
    is raised here; leaving early, or an exception, cancels the streams still running, which closes
    them (their own cleanup runs in their tasks: nothing here has to be awaited)."""
    if len(streams) == 1:       # the usual request: no task and queue between it and the client
        async with aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((index, _ITEM, item))
            queue.put_nowait((index, _DONE, None))
        except Exception as error:
            queue.put_nowait((index, _ERROR, error))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, kind, value = await queue.get()
            if kind == _ERROR:
                raise value
            if kind == _DONE:
                running -= 1
            else:
                yield index, value
    finally:
        for task in tasks:
            task.cancel()


class InFlight:
    """The engine requests running now, so that a shutting-down server can end them at once: each
    then finishes with finish_reason "abort", and its HTTP response ends normally."""

    def __init__(self, engine):
        self.engine = engine
        self.request_ids: set[str] = set()

    async def track(self, request_id: str, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        self.request_ids.add(request_id)
        try:
            async with aclosing(stream):
                async for item in stream:
                    yield item
        finally:
            self.request_ids.discard(request_id)

    async def abort_all(self) -> None:
        if not getattr(self.engine, "is_running", True):
            return      # a dead engine has failed every request already (EngineDeadError): none to abort
        for request_id in list(self.request_ids):
            await self.engine.abort(request_id)


async def unless_disconnected(request: Request, handler: Awaitable[Response]) -> Response:
    """Await the handler, but cancel it if the client goes away first (a non-streamed completion whose
    client left would otherwise run to the end for nobody). Streams notice on their own: see EventStream."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(handler), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        left = not work.done()      # the client left first (a cancel takes effect a loop turn later)
        if left:
            work.cancel()
    if left or work.cancelled():
        return Response(status_code=499)    # nginx's "client closed request": nobody reads it
    return work.result()


class EventStream(StreamingResponse):
    """A server-sent-events response that closes its generator however the response ends. A client that
    leaves cancels the response, maybe while the generator waits at a `yield`, where nothing would close
    it (and cancel its engine requests) but the garbage collector."""
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], source: AsyncIterator | None = None, **kwargs: Any):
        """`source`: what `content` reads from, closed too (if the client left before the first chunk,
        `content` never started, and closing it closes nothing)."""
        super().__init__(content, headers={"Cache-Control": "no-cache"}, **kwargs)
        self.source = source

    async def stream_response(self, send: Callable) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                if self.source is not None:
                    await self.source.aclose()


def sse(data: str) -> str:
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
