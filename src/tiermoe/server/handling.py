"""Reading request bodies and running route bodies with uniform error handling.

The rule every route follows: nothing in a request's content can become a 5xx. Bad values are
refused by explicit checks (4xx naming the field); should one slip past them and raise a
TypeError, ValueError, RecursionError or the like (errors.CONTENT_ERRORS) before the request
reached the engine, only its content and the server's settings were involved, so
`run_endpoint` answers 400 for it. Other exceptions, and any past that point (`reached_engine`,
set by ServerContext.start_runs), are the server's or the engine's: 500.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from tiermoe.server.context import Reservation, ServerContext, reached_engine, reservation
from tiermoe.server.errors import APIError, content_error, error_response, from_validation_error, to_api_error
from tiermoe.server.streaming import ClientGone

def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")


async def parse_body(request: Request, model: type[BaseModel]):
    """Read the body (capped) and validate it strictly; every failure is a 4xx APIError."""
    ctx: ServerContext = request.app.state.ctx
    limit = ctx.config.max_body_bytes
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "client disconnected while sending the body") from None
    raw = b"".join(chunks) or b""
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (Windows tools write one): RFC 8259 lets
        raw = raw[3:]  # a parser ignore it, and pydantic reads it as a character before the value
    try:
        # in place: pydantic-core holds the GIL while it validates, so a worker thread would stall the
        # event loop as long; what bounds the stall is the body limit (--max-body-bytes)
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


Handler = Callable[[Request, ServerContext], Awaitable[Response]]


async def run_endpoint(request: Request, handler: Handler) -> Response:
    """Run a route body; exceptions become error bodies (the right shape for the path)."""
    ctx: ServerContext = request.app.state.ctx
    token = reached_engine.set(False)
    held = Reservation()
    held_token = reservation.set(held)
    try:
        return await handler(request, ctx)
    except ClientGone:
        return Response(status_code=499)
    except Exception as exc:  # APIError, validation, engine refusals, bugs
        err = to_api_error(exc) if reached_engine.get() else content_error(exc)
        return error_response(request.url.path, err)
    finally:
        # queue slots admitted but never handed to the engine (a 4xx after admission, a client
        # gone while tokenizing): released on every path, or the queue would shrink for good
        ctx.release(held)
        reservation.reset(held_token)
        reached_engine.reset(token)
