"""Connection hygiene: slots per client address, header and body read timeouts, keep-alive.

Without these, as many sockets as `--max-connections` that sent request headers and never the
body held every slot for as long as they stayed open, and every other client got 429 while
/health said 200. Four rules close that, as production HTTP servers do:

  - body timeout (`--body-timeout`, the Guard's `receive` wrapper): a request's body must
    arrive in full within this many seconds of its headers, else 408 and the connection is
    closed (its slot is free again);
  - header timeout (`--header-timeout`, the uvicorn protocol below): a connection must finish
    sending a request's headers within this many seconds of opening, or of its previous
    response; else 408 (if part of a request came) and the connection is closed. h11 bounds
    only a header block still incomplete (16 KiB: past it the connection is closed without a
    response); a larger block that arrives in one read is accepted;
  - idle keep-alive (`--keep-alive-timeout`): an idle connection between requests is closed;
  - a per-client share (`--max-connections-per-client`, default half of `--max-connections`):
    no one address (IPv6: one /64 network) may hold more API request slots than that, so one
    client cannot take every slot. Loopback is an address like any other. The address is the
    connection's peer, or the X-Forwarded-For address when the peer is a trusted proxy
    (uvicorn's forwarded-allow-ips: 127.0.0.1 unless $FORWARDED_ALLOW_IPS names others); behind
    a proxy that is not trusted so, every request counts against the proxy's own address:
    raise the share to `--max-connections` there and let the proxy limit its clients.

/health answers 503 "saturated" while every slot is taken (the server is refusing everyone).

The live stats streams (`/v1/stats/stream`, one per open dashboard) are counted in a pool of their
own, with the same two limits. A stream stays open for as long as its page does while costing next
to nothing (one sampler serves them all), so in the API pool a user's few dashboard tabs took that
address's whole share for good: its API requests, and the page itself, got 429, and enough
dashboards made /health report an idle server "saturated". Left uncounted they would be sockets
without bound; in their own pool they stay bounded and leave the API slots to requests.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging

from tiermoe.server.errors import APIError, error_body
from tiermoe.server.web_routes import STREAM_PATH

log = logging.getLogger("tiermoe.server")


def client_key(scope) -> str:
    """The address a request's slots are counted under: the peer's IP, an IPv6 peer's /64."""
    client = scope.get("client")
    host = client[0] if client else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host  # a unix socket or a test transport: one shared key
    if address.version == 4:
        return str(address)
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))  # one /64: one site or host


class ConnectionSlots:
    """API requests being handled now, in all and per client address (one event loop: no lock)."""

    def __init__(self, limit: int | None, per_client: int | None, retry_after_s: int, *,
                 what: str = "concurrent requests", streams: ConnectionSlots | None = None):
        self.limit = limit
        self.per_client = per_client
        self.retry_after_s = retry_after_s
        self.what = what  # what the slots hold, for the 429's message
        self.active = 0
        self.by_client: dict[str, int] = {}
        self.streams = streams  # the live stats streams' own pool (module doc); None: they share this one

    @classmethod
    def with_stream_pool(cls, limit: int | None, per_client: int | None, retry_after_s: int) -> ConnectionSlots:
        """The API pool, with a pool of the same limits for the live stats streams."""
        streams = cls(limit, per_client, retry_after_s, what="open stats streams")
        return cls(limit, per_client, retry_after_s, streams=streams)

    def pool(self, path: str) -> ConnectionSlots:
        """The pool a request to `path` takes its slot from."""
        return self.streams if path == STREAM_PATH and self.streams is not None else self

    @property
    def saturated(self) -> bool:
        return self.limit is not None and self.active >= self.limit

    def refusal(self, key: str) -> APIError | None:
        """The 429 a new request from `key` gets now, or None if it may take a slot."""
        retry = {"Retry-After": str(self.retry_after_s)}
        if self.saturated:
            return APIError(429, f"too many {self.what} ({self.active}, limit {self.limit}); retry shortly",
                            code="too_many_connections", headers=retry)
        held = self.by_client.get(key, 0)
        if self.per_client is not None and held >= self.per_client:
            return APIError(429, f"too many {self.what} from this client address ({held}, limit "
                                 f"{self.per_client} per address); retry shortly",
                            code="too_many_client_connections", headers=retry)
        return None

    def take(self, key: str) -> None:
        self.active += 1
        self.by_client[key] = self.by_client.get(key, 0) + 1

    def give(self, key: str) -> None:
        self.active -= 1
        left = self.by_client[key] - 1
        if left:
            self.by_client[key] = left
        else:
            del self.by_client[key]


def with_body_deadline(receive, timeout_s: float | None):
    """`receive` that raises a 408 APIError (connection: close) unless the whole request body has
    arrived within `timeout_s` of the first call; later calls (disconnect watchers) are unbounded."""
    if timeout_s is None:
        return receive
    deadline = asyncio.get_running_loop().time() + timeout_s
    body_done = False

    async def receive_before_deadline():
        nonlocal body_done
        if body_done:
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            raise APIError(408, f"request body not received within {timeout_s:g} s (server --body-timeout)",
                           code="body_timeout", headers={"Connection": "close"}) from None
        if message.get("type") != "http.request" or not message.get("more_body", False):
            body_done = True
        return message

    return receive_before_deadline


def _header_timeout_response(timeout_s: float) -> bytes:
    message = f"request headers not received within {timeout_s:g} s (server --header-timeout)"
    body = json.dumps(error_body(408, message, None, "header_timeout", False)).encode()
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return head + body


def header_timeout_protocol(timeout_s: float):
    """uvicorn's h11 protocol with a deadline for request headers (uvicorn has none: a socket that
    never finishes its headers, or never sends a byte, stays open for ever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    late_response = _header_timeout_response(timeout_s)

    class HeaderDeadlineProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _upgraded = False  # handed to a websocket protocol: no longer ours to time

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._watch_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch_headers()

        def connection_lost(self, exc) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def handle_websocket_upgrade(self, event) -> None:
            self._upgraded = True
            self._stop_header_timer()
            super().handle_websocket_upgrade(event)

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _watch_headers(self) -> None:
            if self._upgraded or self.transport.is_closing() or not self._awaiting_headers():
                self._stop_header_timer()
            elif self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or not self._awaiting_headers():
                return
            partial, _ = self.conn.trailing_data  # bytes of a request not yet complete
            if partial:
                log.debug("closing a connection from %s: request headers not received in time", self.client)
                self.transport.write(late_response)
            self.transport.close()

    return HeaderDeadlineProtocol


def uvicorn_config(app, *, host: str, port: int, log_level: str = "info", graceful_timeout_s: int = 30):
    """The uvicorn configuration `tiermoe serve` runs `app` (from create_app) with: its connection
    timeouts come from the app's ServerConfig."""
    import uvicorn

    config = app.state.ctx.config
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                          http=header_timeout_protocol(config.header_timeout_s),
                          timeout_keep_alive=config.keep_alive_timeout_s,
                          timeout_graceful_shutdown=graceful_timeout_s)
