"""Delivery: SSE responses that watch for disconnects beside the stream, and run helpers.

The disconnect check must never sit on the per-event path: awaiting "is the client still
there?" before each event throttles delivery to the poll rate. `EventStream` instead runs one
watcher task on the ASGI `receive` channel beside the sender; a disconnect cancels the sender,
whose generator then aborts its engine requests (freed within one engine step). Non-streaming
requests get the same guarantee from `until_disconnect`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import Response

from tiermoe.protocol import GRAMMAR_ERROR, STORE_CODES
from tiermoe.server.errors import APIError, sse_error_event
from tiermoe.server.generation import ChoiceRun, Delta

log = logging.getLogger("tiermoe.server")


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


class EventStream(Response):
    """text/event-stream response; `on_close` runs however the stream ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None] | None = None,
                 headers: dict | None = None):
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        self.init_headers({**base, **(headers or {})})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch)
                try:
                    await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                    async with aclosing(self.events) as events:
                        async for chunk in events:
                            await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:
                    pass  # the client went away mid-send
                except Exception as exc:  # a bug mid-stream: tell the client in-band, end cleanly
                    log.exception("stream failed")
                    err = sse_error_event(scope.get("path", ""), f"internal server error: {type(exc).__name__}")
                    try:
                        await send({"type": "http.response.body", "body": err.encode(), "more_body": False})
                    except OSError:
                        pass
                tg.cancel_scope.cancel()
        finally:
            if self.on_close is not None:
                self.on_close()


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


async def until_disconnect(request: Request, work: Awaitable):
    """Run `work`, cancelling it if the client disconnects first (then raise ClientGone)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    raise ClientGone()


async def drain(runs: list[ChoiceRun]) -> None:
    """Run every choice to its end (non-streaming); outputs accumulate in the runs.

    A choice the engine failed turns the whole response into a 500 with the engine's
    message, a 503 when the expert store failed, or a 400 when the grammar engine could not
    follow the request's own response format (other requests are unaffected; the engine keeps
    serving).
    """
    try:
        await asyncio.gather(*(_consume(r) for r in runs))
    finally:
        for r in runs:
            r.abort()
    failed = [r for r in runs if r.finish_reason == "error"]
    if failed:
        if failed[0].timed_out:
            raise APIError(504, failed[0].error, code="request_timeout")
        if failed[0].error_code in STORE_CODES:
            raise APIError(503, f"expert store: {failed[0].error}", code=failed[0].error_code)
        if failed[0].error_code == GRAMMAR_ERROR:  # the request's own format: as if refused up front
            raise APIError(400, f"the response format cannot be enforced: {failed[0].error}", code="unsupported_schema")
        raise APIError(500, failed[0].error or "engine error", code="engine_error")


async def _consume(run: ChoiceRun) -> None:
    async for _ in run.deltas():
        pass


async def merged(runs: list[ChoiceRun]) -> AsyncIterator[tuple[ChoiceRun, Delta]]:
    """Interleave the deltas of several choices as they arrive (n > 1)."""
    if len(runs) == 1:
        async with aclosing(runs[0].deltas()) as it:
            async for d in it:
                yield runs[0], d
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for d in run.deltas():
                queue.put_nowait((run, d))
        finally:
            queue.put_nowait((run, done))

    tasks = [asyncio.ensure_future(pump(r)) for r in runs]
    try:
        remaining = len(runs)
        while remaining:
            run, item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            yield run, item
        for t in tasks:
            t.result()  # surface a pump's exception
    finally:
        for t in tasks:
            t.cancel()
        for r in runs:
            r.abort()
