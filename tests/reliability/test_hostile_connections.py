"""Connections that hold the server without ever finishing a request: bodies that never come,
headers that never end, silent sockets, idle keep-alives, and one address taking every slot.

Each must be answered (408 / 429 with the API's error body) or closed within its deadline, and
a normal client must be served at once meanwhile and afterwards. The attacker's sockets come
from 127.0.0.2 (Linux routes all of 127/8 to loopback), so the per-address share can be told
apart from the normal client on 127.0.0.1.
"""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from reliability_util import ServeProcess, assert_error_body, healthy, scripted_server, served_like_the_cli

ATTACKER = "127.0.0.2"
CHAT = "/v1/chat/completions"
HEADERS_ONLY = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 100\r\n\r\n")


class RawResponse:
    """Status, headers and body of one HTTP response read off a raw socket (for assert_error_body)."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status_code, self.headers, self.text = status, headers, body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.text)


def attacker_socket(port: int) -> socket.socket:
    sock = socket.socket()
    try:
        sock.bind((ATTACKER, 0))
    except OSError as exc:
        sock.close()
        pytest.skip(f"cannot bind {ATTACKER} here: {exc}")
    sock.connect(("127.0.0.1", port))
    return sock


def read_response(sock: socket.socket, timeout: float) -> RawResponse | None:
    """One response (by its content-length), or None if none came within `timeout`."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        while len(body) < int(headers.get("content-length", 0)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    except (TimeoutError, socket.timeout):
        return None
    return RawResponse(int(lines[0].split()[1]), headers, body)


def closed_within(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes `sock` within `timeout` (anything it still sends is skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except (TimeoutError, socket.timeout):
            return False
        except ConnectionResetError:
            return True
    return False


def answered_at_once(url: str) -> None:
    t0 = time.monotonic()
    r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}, timeout=10)
    assert r.status_code == 200 and time.monotonic() - t0 < 1.0, (r.status_code, time.monotonic() - t0)


def test_headers_only_requests_cannot_lock_out_other_clients():
    """Twice as many headers-only requests as there are slots, from one address: half are refused
    at once (the address's share), the rest get 408 at the body deadline and are closed; a normal
    client is answered at once throughout, and every slot is free afterwards."""
    server = scripted_server(max_num_seqs=4, max_connections=8, body_timeout_s=1.5)
    with served_like_the_cli(server) as s:
        socks = [attacker_socket(s.port) for _ in range(8)]
        for sock in socks:
            sock.sendall(HEADERS_ONLY)
        t0 = time.monotonic()
        refused, held = [], list(socks)
        while len(refused) < 4 and time.monotonic() - t0 < 2:
            ready, _, _ = select.select(held, [], [], 0.1)
            for sock in ready:
                refused.append(read_response(sock, 1.0))
                held.remove(sock)
        assert len(refused) == 4 and len(held) == 4
        for r in refused:
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            err = assert_error_body(CHAT, r)
            assert err["code"] == "too_many_client_connections" and "limit 4 per address" in err["message"]
        answered_at_once(s.url)  # the other half of the slots is still free for everyone else
        assert httpx.get(s.url + "/health").status_code == 200
        for sock in held:
            r = read_response(sock, 4.0)
            assert r is not None and r.status_code == 408 and time.monotonic() - t0 < 4.0
            err = assert_error_body(CHAT, r)
            assert err["code"] == "body_timeout" and "--body-timeout" in err["message"]
            assert closed_within(sock, 2.0)
        for sock in socks:
            sock.close()
        assert s.app.state.ctx.connections.active == 0
        answered_at_once(s.url)
        assert healthy(s.url)


def test_health_reports_a_server_refusing_everyone():
    """When one address may take every slot (a reverse proxy's case) and does, /health says so
    with 503 until the body deadline frees the slots."""
    server = scripted_server(max_num_seqs=4, max_connections=4, max_connections_per_client=4, body_timeout_s=1.5)
    with served_like_the_cli(server) as s:
        socks = [attacker_socket(s.port) for _ in range(4)]
        for sock in socks:
            sock.sendall(HEADERS_ONLY)
        deadline = time.monotonic() + 2
        while s.app.state.ctx.connections.active < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503
        assert health.json() == {"status": "saturated", "active_requests": 4, "max_connections": 4}
        r = httpx.post(s.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and assert_error_body(CHAT, r)["code"] == "too_many_connections"
        for sock in socks:
            r = read_response(sock, 4.0)
            assert r is not None and r.status_code == 408
            sock.close()
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
        answered_at_once(s.url)


def test_header_and_keep_alive_deadlines_of_tiermoe_serve():
    """`tiermoe serve` closes a connection whose request headers never end (408 first), one that
    never sends a byte, and an idle keep-alive connection, each at its deadline."""
    with ServeProcess(["--scripted", "--header-timeout", "1", "--keep-alive-timeout", "1"]) as p:
        partial = socket.create_connection(("127.0.0.1", p.port))
        partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: appl")
        silent = socket.create_connection(("127.0.0.1", p.port))
        idle = socket.create_connection(("127.0.0.1", p.port))
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = time.monotonic()
        assert read_response(idle, 2.0).status_code == 200
        r = read_response(partial, 3.0)
        assert r is not None and r.status_code == 408 and 0.8 < time.monotonic() - t0 < 3.0
        err = assert_error_body(CHAT, r)
        assert err["code"] == "header_timeout" and "--header-timeout" in err["message"]
        assert closed_within(partial, 1.0) and closed_within(silent, 2.0) and closed_within(idle, 2.0)
        assert time.monotonic() - t0 < 4.0
        for sock in (partial, silent, idle):
            sock.close()
        answered_at_once(p.url)


def test_connection_flags_are_checked_and_documented(capsys):
    import argparse

    from tiermoe.errors import UserError
    from tiermoe.server.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for flags in (["--header-timeout", "0"], ["--body-timeout", "-1"], ["--keep-alive-timeout", "0"],
                  ["--max-connections-per-client", "0"]):
        args = parser.parse_args(["serve", "--scripted", *flags])
        with pytest.raises(UserError, match=flags[0]):
            args.handler(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for needle in ("--header-timeout", "--body-timeout", "--keep-alive-timeout", "--max-connections-per-client",
                   "64 levels", "10000 JSON values", "look-around", "saturated", "--max-body-mb"):
        assert needle in text, needle
