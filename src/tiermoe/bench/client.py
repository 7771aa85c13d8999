"""HTTP side of the benchmarks: talk to any OpenAI-compatible server and time what arrives.

Every measurement in `tiermoe bench` is taken from the client's side of the wire, because that
is what users experience (a server can generate at full speed and still deliver in bursts).
Streams are read line by line and each SSE event is stamped with `time.perf_counter()` the
moment it is parsed, relative to the moment the request was sent.

Only httpx is used here (no torch): the benchmarks must run against a peer's server from a
laptop that has nothing else installed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tiermoe.errors import UserError

DEFAULT_TIMEOUT_S = 900.0


class BenchHTTPError(UserError):
    """The server answered with a status or body the benchmark cannot use."""


@dataclass
class StreamEvent:
    """One SSE data event: arrival time (s since the request was sent) and the text it carried."""

    t: float
    text: str = ""  # content + reasoning text of this event
    content: str = ""
    reasoning: str = ""
    has_tool_call: bool = False


@dataclass
class StreamResult:
    """Everything a streamed request delivered, with per-event arrival times."""

    events: list[StreamEvent] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    tool_calls: list[dict] = field(default_factory=list)
    t_end: float = 0.0  # when the stream closed (s since send)
    truncated: bool = False  # the reader stopped early (stop_after)

    @property
    def token_events(self) -> list[StreamEvent]:
        """Events that carried generated output (text or a tool-call fragment)."""
        return [e for e in self.events if e.text or e.has_tool_call]

    @property
    def ttft(self) -> float | None:
        """Time to the first generated output; the close time when nothing was generated."""
        ev = self.token_events
        if ev:
            return ev[0].t
        return self.t_end if self.events else None

    @property
    def completion_tokens(self) -> int:
        """The server's own count when it reports usage, else one token per output event."""
        if self.usage and isinstance(self.usage.get("completion_tokens"), int) and not self.truncated:
            return int(self.usage["completion_tokens"])
        return len(self.token_events)

    @property
    def prompt_tokens(self) -> int | None:
        if self.usage and isinstance(self.usage.get("prompt_tokens"), int):
            return int(self.usage["prompt_tokens"])
        return None

    def per_stream_rate(self) -> float | None:
        """Decode rate of this stream: (n - 1) / (last - first) over output events."""
        ev = self.token_events
        n = self.completion_tokens
        if n < 2 or len(ev) < 2 or ev[-1].t <= ev[0].t:
            return None
        return (n - 1) / (ev[-1].t - ev[0].t)

    def tokens_per_event(self) -> float:
        """Average tokens an output event carried (1.0 for a server that streams per token)."""
        ev = self.token_events
        if not ev:
            return 1.0
        if self.usage and isinstance(self.usage.get("completion_tokens"), int) and not self.truncated:
            return max(self.usage["completion_tokens"], 1) / len(ev)
        return 1.0


# Fields every bench config carries to reach a server; they say where a result was measured
# (recorded as the result's own url/model), not how.
CONNECTION_FIELDS = ("url", "model", "timeout", "api_key")


def settings(cfg: Any) -> dict:
    """A bench config dataclass's settings, connection fields left out: the "config" a result
    records, so that a number can be reproduced and two results compared like for like."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in CONNECTION_FIELDS}


def make_client(url: str, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    return httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout, headers=headers, limits=limits)


def _describe(exc: Exception, url: str) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect to {url} ({exc})"
    if isinstance(exc, httpx.TimeoutException):
        return f"request to {url} timed out ({type(exc).__name__})"
    return f"request to {url} failed: {type(exc).__name__}: {exc}"


def _check(resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        body = resp.text[:300].replace("\n", " ")
        raise BenchHTTPError(f"{resp.request.method} {resp.request.url.path} -> HTTP {resp.status_code}: {body}")
    try:
        return resp.json()
    except ValueError as exc:
        raise BenchHTTPError(f"{resp.request.url.path} answered with non-JSON: {resp.text[:200]!r}") from exc


async def get_json(client: httpx.AsyncClient, path: str) -> Any:
    try:
        resp = await client.get(path)
    except httpx.HTTPError as exc:
        raise BenchHTTPError(_describe(exc, str(client.base_url) + path)) from exc
    return _check(resp)


async def post_json(client: httpx.AsyncClient, path: str, payload: dict) -> Any:
    try:
        resp = await client.post(path, json=payload)
    except httpx.HTTPError as exc:
        raise BenchHTTPError(_describe(exc, str(client.base_url) + path)) from exc
    return _check(resp)


async def list_models(client: httpx.AsyncClient) -> list[dict]:
    data = await get_json(client, "/v1/models")
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list):
        raise BenchHTTPError("/v1/models did not return a 'data' list")
    return [m for m in models if isinstance(m, dict)]


async def resolve_model(client: httpx.AsyncClient, model: str | None) -> tuple[str, dict]:
    """The model to benchmark (the given name, else the first of /v1/models) and its card."""
    models = await list_models(client)
    if model is None:
        if not models:
            raise BenchHTTPError("/v1/models lists no model; pass --model")
        return str(models[0].get("id")), models[0]
    for card in models:
        if card.get("id") == model:
            return model, card
    return model, {}


def max_model_len(card: dict) -> int | None:
    """Context window from a model card (vLLM-style `max_model_len`, or common aliases)."""
    for key in ("max_model_len", "context_length", "context_window", "max_context_length"):
        value = card.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


# The two /tokenize dialects in use. vLLM's and tiermoe's read {"prompt", "add_special_tokens"}
# and answer {"count", "tokens", ...}; llama-server reads {"content", "add_special",
# "parse_special"} and answers {"tokens": [...]} (ids, or {"id", "piece"} objects with
# `with_pieces`). Each ignores the other's fields, so one body that carries both is understood
# by all three. llama-server answers {"tokens": []} to a body without "content", so an empty
# answer for non-empty text means "this server did not read the text", never "zero tokens".
def tokenize_bodies(model: str, text: str, special: bool) -> list[dict]:
    """Bodies for POST /tokenize, in the order tried: both dialects at once, then each alone
    (for a server that rejects fields it does not know)."""
    ours = {"model": model, "prompt": text, "add_special_tokens": special}
    llama = {"content": text, "add_special": special, "parse_special": special}
    return [{**ours, **llama}, ours, llama]


def parse_tokenize(data: Any, text: str) -> tuple[int, list[int] | None] | None:
    """(token count, ids or None) from either dialect's answer; None when it is unusable."""
    if not isinstance(data, dict):
        return None
    raw = data.get("tokens")
    ids: list[int] | None = None
    if isinstance(raw, list):
        ids = [t.get("id") if isinstance(t, dict) else t for t in raw]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            ids = None
    count = data.get("count")
    if not isinstance(count, int) or isinstance(count, bool):
        count = len(raw) if isinstance(raw, list) else None
    if count is None or (text and count == 0):
        return None
    return count, ids


async def _tokenize(
    client: httpx.AsyncClient, model: str, text: str, special: bool
) -> tuple[int, list[int] | None] | None:
    """POST /tokenize (or /v1/tokenize) in a body every known dialect reads; None if no server tokenizer."""
    for path in ("/tokenize", "/v1/tokenize"):
        for body in tokenize_bodies(model, text, special):
            try:
                resp = await client.post(path, json=body)
            except httpx.HTTPError:
                return None
            if resp.status_code in (404, 405, 501):
                break  # no such route: try the next path
            if resp.status_code in (400, 422):
                continue  # this body was refused: try the next one
            if resp.status_code >= 400:
                return None
            try:
                data = resp.json()
            except ValueError:
                return None
            parsed = parse_tokenize(data, text)
            if parsed is not None:
                return parsed
        else:
            return None  # the route exists but no body was understood
    return None


async def count_tokens(client: httpx.AsyncClient, model: str, text: str, special: bool = False) -> int | None:
    """Token count of `text` from the server's /tokenize, or None if it has none."""
    parsed = await _tokenize(client, model, text, special)
    return None if parsed is None else parsed[0]


async def token_ids(client: httpx.AsyncClient, model: str, text: str, special: bool = True) -> list[int] | None:
    """The ids /tokenize gives `text` (with special tokens, as /v1/completions encodes a prompt)."""
    parsed = await _tokenize(client, model, text, special)
    return None if parsed is None else parsed[1]


def _parse_chunk(obj: dict, res: StreamResult, t: float) -> None:
    if isinstance(obj.get("usage"), dict):
        res.usage = obj["usage"]
    if "error" in obj and not obj.get("choices"):
        err = obj["error"]
        msg = err.get("message") if isinstance(err, dict) else str(err)
        raise BenchHTTPError(f"stream error: {msg}")
    choices = obj.get("choices") or []
    if not choices:
        res.events.append(StreamEvent(t=t))
        return
    ch = choices[0]
    ev = StreamEvent(t=t)
    delta = ch.get("delta")
    if isinstance(delta, dict):  # chat completion chunk
        ev.content = delta.get("content") or ""
        ev.reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        for tc in delta.get("tool_calls") or []:
            ev.has_tool_call = True
            _merge_tool_call(res.tool_calls, tc)
    else:  # text completion chunk
        ev.content = ch.get("text") or ""
    ev.text = ev.reasoning + ev.content
    res.content += ev.content
    res.reasoning += ev.reasoning
    if ch.get("finish_reason"):
        res.finish_reason = ch["finish_reason"]
    res.events.append(ev)


def _merge_tool_call(calls: list[dict], frag: dict) -> None:
    idx = frag.get("index", len(calls))
    while len(calls) <= idx:
        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[idx]
    if frag.get("id"):
        call["id"] = frag["id"]
    fn = frag.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] += fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]


async def stream(
    client: httpx.AsyncClient,
    path: str,
    payload: dict,
    *,
    stop_after: float | None = None,
) -> StreamResult:
    """POST a streaming request and stamp every SSE event on arrival.

    `stop_after`: stop reading (and close the connection) this many seconds after the first
    output event; the result is then marked `truncated`.
    """
    body = dict(payload, stream=True)
    body.setdefault("stream_options", {"include_usage": True})
    try:
        return await _stream_once(client, path, body, stop_after)
    except _Rejected as rej:
        # Some servers reject stream_options; retry without it (counts then come from events).
        if "stream_options" in payload or rej.status not in (400, 422):
            raise rej.error from None
        body.pop("stream_options")
        try:
            return await _stream_once(client, path, body, stop_after)
        except _Rejected as rej2:
            raise rej2.error from None


class _Rejected(Exception):
    def __init__(self, status: int, error: BenchHTTPError):
        self.status, self.error = status, error


async def _stream_once(client: httpx.AsyncClient, path: str, body: dict, stop_after: float | None) -> StreamResult:
    res = StreamResult()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                try:
                    _check(resp)
                except BenchHTTPError as exc:
                    raise _Rejected(resp.status_code, exc) from None
            first_out: float | None = None
            async for line in resp.aiter_lines():
                t = time.perf_counter() - t0
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except ValueError as exc:
                    raise BenchHTTPError(f"{path}: bad SSE data {data[:120]!r}") from exc
                _parse_chunk(obj, res, t)
                ev = res.events[-1] if res.events else None
                if first_out is None and ev is not None and (ev.text or ev.has_tool_call):
                    first_out = ev.t
                if stop_after is not None and first_out is not None and t - first_out >= stop_after:
                    res.truncated = True
                    break
    except httpx.HTTPError as exc:
        raise BenchHTTPError(_describe(exc, str(client.base_url) + path)) from exc
    res.t_end = time.perf_counter() - t0
    return res


def chat_payload(model: str, messages: list[dict], max_tokens: int | None = None, **extra: Any) -> dict:
    """A greedy chat request (temperature 0), max_tokens left to the server when None."""
    body: dict[str, Any] = {"model": model, "messages": messages, "temperature": 0}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body.update(extra)
    return body


def message_text(resp: dict) -> tuple[str, str, str | None, list[dict]]:
    """(content, reasoning, finish_reason, tool_calls) of a non-streamed chat completion."""
    choices = resp.get("choices") or [{}]
    ch = choices[0] or {}
    msg = ch.get("message") or {}
    content = msg.get("content") or ""
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
    return content, reasoning, ch.get("finish_reason"), list(msg.get("tool_calls") or [])
