"""The FastAPI application: routes, auth, body limits, lifecycle.

`create_app(engine, ...)` wires an `AsyncEngine` to the HTTP API. The app starts the
engine thread on startup and drains it on shutdown (uvicorn first stops accepting and lets
open responses finish, then the lifespan drains what is left).

Request flow: `Guard` (pure ASGI: API key, body size, connection slots, body read deadline,
per-endpoint request counts) -> route -> `parse_body` (strict pydantic on the raw bytes) ->
endpoint module (chat.py helpers, generation.ChoiceRun) -> JSON or `streaming.EventStream`. Any
exception becomes a JSON error body through errors.py; bad input is always 4xx (handling.py).

This module imports no torch (tests assert it).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tiermoe.engine.async_engine import AsyncEngine
from tiermoe.protocol import STORE_CORRUPT
from tiermoe.server import anthropic_routes, openai_routes, openapi, responses_routes, web_routes
from tiermoe.server.chat import openai_messages, plan_tools
from tiermoe.server.connections import client_key, with_body_deadline
from tiermoe.server.context import ServerConfig, ServerContext
from tiermoe.server.errors import APIError, bad_request, error_body, install_handlers, is_anthropic_path
from tiermoe.server.handling import parse_body, run_endpoint, too_large
from tiermoe.server.live_stats import LiveStats, ThroughputLog
from tiermoe.server.protocol import DetokenizeRequest, TokenizeRequest
from tiermoe.server.sampling_defaults import SamplingDefaults

log = logging.getLogger("tiermoe.server")

OPEN_PATHS = {"/health", "/metrics", "/ping"}
KNOWN_PATHS = {
    "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
    "/tokenize", "/detokenize", "/v1/models", "/health", "/metrics", "/stats", "/ping", "/openapi.json",
    "/", web_routes.STREAM_PATH,
}


# GET routes also answered for HEAD (as GET, without the body): uptime monitors and load balancers
# probe with HEAD, and FastAPI's GET routes answer it 405. Streams are left out (a HEAD would hold
# a stream open that sends nothing).
HEAD_PATHS = {"/health", "/ping", "/metrics", "/stats", "/v1/models", "/"}
HEAD_PREFIXES = ("/v1/models/", web_routes.ASSET_PREFIX)


def answers_head(path: str) -> bool:
    return path in HEAD_PATHS or path.startswith(HEAD_PREFIXES)


def _without_body(send):
    """`send` for a HEAD answered as GET: the status and headers (Content-Length included, as
    RFC 9110 allows), no body bytes."""
    async def head_send(message):
        if message["type"] == "http.response.body":
            if message.get("more_body", False):
                return
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await send(message)

    return head_send


class Guard:
    """Pure ASGI middleware (keeps streaming and disconnect detection intact).

    Checks the API key (constant-time; `Authorization: Bearer` or Anthropic's `x-api-key`),
    refuses bodies over the limit by Content-Length (413; chunked bodies are capped while
    read), bounds concurrent API requests in all and per client address (429 + Retry-After;
    probes are never refused, so a saturated server still answers /health), gives every body a
    read deadline (408, connections.py), and counts responses per endpoint and status.
    """

    def __init__(self, app, ctx: ServerContext):
        self.app = app
        self.ctx = ctx
        self.key = ctx.config.api_key.encode() if ctx.config.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in KNOWN_PATHS else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        metrics = self.ctx.metrics
        if scope.get("method") == "HEAD" and answers_head(path):
            scope = {**scope, "method": "GET"}  # a copy: the HTTP layer still knows it is a HEAD
            send = _without_body(send)

        async def counted_send(message):
            if message["type"] == "http.response.start":
                metrics.observe_request(endpoint, message["status"])
            await send(message)

        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        # the web page's shell holds no data and asks for the key itself (web_routes.py)
        needs_key = path not in OPEN_PATHS and not web_routes.is_shell_path(path)
        if self.key is not None and needs_key and scope.get("method") != "OPTIONS":
            auth = headers.get("authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get("x-api-key", b"")
            if not hmac.compare_digest(token, self.key):
                msg = "missing API key" if not token else "invalid API key"
                return await _send_error(counted_send, path, APIError(401, msg, code="invalid_api_key"))
        encoding = headers.get("content-encoding", b"").strip().lower()
        if encoding not in (b"", b"identity"):
            # the body would be read as JSON still compressed ("not valid JSON"): say what is wrong
            shown = encoding.decode("latin-1")[:40]
            return await _send_error(counted_send, path, APIError(
                415, f"Content-Encoding {shown} is not supported; send the request body uncompressed",
                code="unsupported_content_encoding"))
        length = headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.ctx.config.max_body_bytes
            except ValueError:
                return await _send_error(counted_send, path, bad_request("invalid Content-Length header"))
            if too_big:
                return await _send_error(counted_send, path, too_large(self.ctx.config.max_body_bytes))
        receive = with_body_deadline(receive, self.ctx.config.body_timeout_s)
        if path in OPEN_PATHS:
            return await self.app(scope, receive, counted_send)
        slots, client = self.ctx.connections.pool(path), client_key(scope)
        refusal = slots.refusal(client)
        if refusal is not None:
            metrics.rejected.inc()
            return await _send_error(counted_send, path, refusal)
        slots.take(client)
        try:
            await self.app(scope, receive, counted_send)
        finally:
            slots.give(client)


async def _send_error(send, path: str, err: APIError) -> None:
    body = json.dumps(error_body(err.status, err.message, err.param, err.code, is_anthropic_path(path))).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    for k, v in (err.headers or {}).items():
        headers.append((k.lower().encode("latin-1"), str(v).encode("latin-1")))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(
    engine: AsyncEngine,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_model_len: int | None = None,
    max_queue: int = 256,
    max_body_bytes: int = 32 * 1024 * 1024,
    tool_format: str | None = None,
    reasoning: bool | None = None,
    thinking_budget: int | None = None,
    cors_origins: list[str] | None = None,
    drain_timeout_s: float = 30.0,
    aliases: list[str] | None = None,
    request_timeout_s: float | None = None,
    max_connections: int | None = None,
    max_connections_per_client: int | None = None,
    body_timeout_s: float | None = 30.0,
    header_timeout_s: float = 10.0,
    keep_alive_timeout_s: float = 5.0,
    web: bool = True,
    sampling_defaults: SamplingDefaults | None = None,
) -> FastAPI:
    """An ASGI app serving `engine` under `served_model_name`.

    max_model_len caps the context below the engine's own; max_queue bounds how many requests
    may wait beyond the engine's running capacity before new ones get 429 + Retry-After.
    tool_format: "hermes" | "glm" | None (detect). reasoning: parse <think> (None: detect).
    request_timeout_s: a generation still running after this long is aborted (504, or an
    in-stream error). max_connections: concurrent API requests before 429 (None: the engine's
    capacity + max_queue + 32, so requests still reading or tokenizing their bodies are bounded
    too; probes are not counted); max_connections_per_client: of those, from one address (None:
    half). body_timeout_s: a request body must arrive within this (408; None: no deadline).
    header_timeout_s, keep_alive_timeout_s: for the uvicorn protocol (connections.uvicorn_config).
    web: serve the built-in page at / (web_routes.py; the live stats stream is served either way).
    sampling_defaults: what left-out sampling fields of a request take (None: the neutral values,
    temperature 1.0 as in the OpenAI API; sampling_defaults.py).
    """
    if max_connections is None:
        max_connections = engine.capacity + max_queue + 32
    if max_connections_per_client is None:
        max_connections_per_client = max(1, max_connections // 2)
    config = ServerConfig(
        served_model_name=served_model_name, api_key=api_key, max_model_len=max_model_len, max_queue=max_queue,
        max_body_bytes=max_body_bytes, tool_format=tool_format, reasoning=reasoning, thinking_budget=thinking_budget,
        cors_origins=list(cors_origins or []), aliases=list(aliases or []),
        request_timeout_s=request_timeout_s, max_connections=max_connections,
        max_connections_per_client=max_connections_per_client, body_timeout_s=body_timeout_s,
        header_timeout_s=header_timeout_s, keep_alive_timeout_s=keep_alive_timeout_s,
        sampling_defaults=sampling_defaults or SamplingDefaults(),
    )
    ctx = ServerContext(engine, config)
    live = LiveStats(ctx)
    throughput = ThroughputLog(ctx)  # the log's periodic throughput line (access_log.py)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        throughput.start()
        log.info("serving %s (context %d tokens, tool format %s)", served_model_name, ctx.max_model_len,
                 ctx.tool_format)
        try:
            yield
        finally:
            await throughput.stop()
            live.stop()
            await engine.shutdown(drain_timeout=drain_timeout_s)
            ctx.close()

    app = FastAPI(title="tiermoe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.ctx = ctx
    app.state.live_stats = live  # the CLI's server ends the open stats streams on exit (cli.py)
    install_handlers(app)
    app.add_middleware(Guard, ctx=ctx)
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        # Retry-After exposed: a browser client reads it on a 429 (queue full) or 503 to know when to come back
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["Retry-After"])

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if engine.store_fault:  # a record failed its checksum (or could not be read): the files are damaged
            message = f"the expert store is damaged: {engine.store_fault}"
            body = error_body(503, message, None, STORE_CORRUPT, False)
            return JSONResponse({"status": "store failed", **body}, status_code=503)
        slots = ctx.connections
        if slots.saturated:  # every API request is being refused (429) right now
            return JSONResponse({"status": "saturated", "active_requests": slots.active,
                                 "max_connections": slots.limit}, status_code=503)
        return {"status": "ok"}

    @app.get("/ping")
    async def ping():
        return await health()

    def model_entry(name: str) -> dict:
        return {
            "id": name, "object": "model", "created": int(ctx.metrics.started), "owned_by": "tiermoe",
            "max_model_len": ctx.max_model_len, "root": engine.model_info.get("name", served_model_name),
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_entry(served_model_name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """OpenAI's models.retrieve: the served model (or an alias) as in the list, else 404.
        Ids may hold '/' (org/name); an empty id (/v1/models/) is the list."""
        if not model_id:
            return await models()
        ctx.check_model(model_id)  # 404 model_not_found for another id
        return model_entry(model_id)

    @app.get("/metrics")
    async def metrics():
        stats = await engine.stats()
        body = ctx.metrics.render(stats, engine.num_unfinished - engine.num_waiting, engine.num_waiting)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats():
        snap = await engine.stats()
        running = engine.num_unfinished - engine.num_waiting
        return {
            "model": served_model_name,
            "max_model_len": ctx.max_model_len,
            "server": ctx.metrics.summary(snap, running, engine.num_waiting),
            "admitting": ctx.reserved,  # admitted, still rendering or tokenizing (queue slots held)
            "engine": snap,
            "time": time.time(),
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await run_endpoint(request, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await run_endpoint(request, _detokenize)

    openai_routes.register(app)
    responses_routes.register(app)
    anthropic_routes.register(app)
    web_routes.register(app, live, web=web)
    openapi.install(app)
    return app


async def _tokenize(request: Request, ctx: ServerContext) -> Response:
    req = await parse_body(request, TokenizeRequest)
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
    if req.messages is not None:
        plan = plan_tools([t.function.model_dump(exclude_none=True) for t in req.tools or []], None, can_parse=True)
        await ctx.check_schemas(plan.schemas)
        text = await ctx.render_chat(openai_messages(req.messages), plan.template_tools, req.chat_template_kwargs,
                                     req.add_generation_prompt)
        ids = await ctx.encode(text, add_special_tokens=False)
    else:
        ids = await ctx.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids})


async def _detokenize(request: Request, ctx: ServerContext) -> Response:
    """Token ids -> text. At most a context's worth of ids (anything the model reads or writes
    fits in it), refused by length before any is read, so a 10-million-id list never stalls the
    event loop; then range-checked in place and decoded on the tokenizer thread."""
    req = await parse_body(request, DetokenizeRequest)
    ctx.check_model(req.model)
    if len(req.tokens) > ctx.max_model_len:
        raise bad_request(f"tokens has {len(req.tokens)} ids; at most this model's context of "
                          f"{ctx.max_model_len} tokens can be detokenized", param="tokens",
                          code="context_length_exceeded")
    ctx.check_token_ids(req.tokens, "tokens")
    return JSONResponse({"prompt": await ctx.decode(req.tokens)})
