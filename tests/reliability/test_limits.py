"""Limits with clear errors: body size, message count and prompt length against the context,
connection and queue limits (429 + Retry-After), the per-request timeout, constant-time API
key checks, CORS off by default, and model names that never touch the filesystem."""

from __future__ import annotations

import sys
import threading
import time

import httpx
import pytest

import tiermoe.server.app as app_module
from reliability_util import assert_error_body, healthy, scripted_server

MSG = [{"role": "user", "content": "hi"}]
STORY = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def small():
    """512-token context, 64 KiB bodies, quick steps."""
    with scripted_server(max_model_len=512, max_num_seqs=8, step_delay_s=0.001, max_body_bytes=64 * 1024) as s:
        yield s


# ---- size and context ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize"])
def test_body_limit_by_length_and_chunked(small, path):
    big = b'{"x": "' + b"a" * 70_000 + b'"}'
    r = httpx.post(small.url + path, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and assert_error_body(path, r)
    r = httpx.post(small.url + path, content=iter([big[:40_000], big[40_000:]]))  # no Content-Length
    assert r.status_code == 413 and assert_error_body(path, r)


def test_too_many_messages_is_400_before_rendering(small):
    r = httpx.post(small.url + "/v1/chat/completions", json={"messages": MSG * 600})
    err = assert_error_body("/v1/chat/completions", r)
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "600 messages" in err["message"] and "512" in err["message"]
    # alternating turns: consecutive user messages are one turn on /v1/messages, as Anthropic combines them
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 300
    r = httpx.post(small.url + "/v1/messages", json={"model": "scripted", "max_tokens": 5, "messages": turns})
    assert r.status_code == 400 and "600 messages" in assert_error_body("/v1/messages", r)["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", lambda t: {"messages": [{"role": "user", "content": t}]}),
    ("/v1/completions", lambda t: {"prompt": t}),
    ("/v1/responses", lambda t: {"input": t}),
    ("/v1/messages", lambda t: {"model": "scripted", "max_tokens": 4, "messages": [{"role": "user", "content": t}]}),
])
def test_prompt_longer_than_context_is_400(small, path, body):
    for text in ("word " * 600, "x" * 60_000):  # just over; far over (refused from a prefix)
        r = httpx.post(small.url + path, json=body(text), timeout=30)
        assert r.status_code == 400, (path, r.text[:200])
        err = assert_error_body(path, r)
        assert "context length is 512" in err["message"]
        if not path.startswith("/v1/messages"):
            assert err["code"] == "context_length_exceeded"


def test_huge_prompt_does_not_stall_other_requests():
    """A prompt hundreds of times the context is refused from a prefix, so a request behind it
    on the one tokenizer thread is not held up for the time tokenizing it all would take."""
    with scripted_server(max_model_len=512, max_body_bytes=8 * 2**20) as s:
        huge = {"messages": [{"role": "user", "content": "y" * (6 * 2**20)}]}
        done = {}

        def send_huge():
            t0 = time.monotonic()
            done["huge"] = httpx.post(s.url + "/v1/chat/completions", json=huge, timeout=60)
            done["huge_s"] = time.monotonic() - t0

        t = threading.Thread(target=send_huge)
        t.start()
        time.sleep(0.05)
        t0 = time.monotonic()
        small_r = httpx.post(s.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 4}, timeout=60)
        small_s = time.monotonic() - t0
        t.join(60)
    assert done["huge"].status_code == 400 and done["huge"].json()["error"]["code"] == "context_length_exceeded"
    assert small_r.status_code == 200
    # tokenizing 6 MB whole takes ~10 s here; the prefix check a few ms
    assert done["huge_s"] < 3 and small_s < 3, (done["huge_s"], small_s)


def test_absurd_max_tokens_is_400(small):
    for value in (10**12, 2**63, 513):
        r = httpx.post(small.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": value})
        assert r.status_code == 400 and assert_error_body("/v1/chat/completions", r)["param"] == "max_tokens"


# ---- concurrency: queue and connections ---------------------------------------------------------------


def _hold_streams(url: str, n: int, stop: threading.Event, started: threading.Barrier | None = None):
    """Open n long streams that each read one event and then stall until `stop`."""
    threads = []

    def one():
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                          json={"messages": STORY, "max_tokens": 400, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            if started is not None:
                started.wait(20)
            stop.wait(30)

    for _ in range(n):
        t = threading.Thread(target=one, daemon=True)
        t.start()
        threads.append(t)
    return threads


def test_queue_full_is_429_with_retry_after_and_probes_stay_open():
    with scripted_server(max_model_len=1024, max_num_seqs=2, step_delay_s=0.01, max_queue=1) as s:
        stop, barrier = threading.Event(), threading.Barrier(4)
        threads = _hold_streams(s.url, 3, stop, barrier)  # 2 running + 1 waiting = the limit
        barrier.wait(20)
        for path, body in [("/v1/chat/completions", {"messages": MSG}),
                           ("/v1/messages", {"model": "scripted", "max_tokens": 4, "messages": MSG})]:
            r = httpx.post(s.url + path, json=body)
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1
            err = assert_error_body(path, r)
            assert err["type"] == "rate_limit_error"
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
        stop.set()
        for t in threads:
            t.join(30)
        assert healthy(s.url)


def test_connection_limit_is_429_with_retry_after():
    # one client address may hold every slot here (the per-client share is tested in test_hostile_connections)
    with scripted_server(max_model_len=1024, max_num_seqs=8, step_delay_s=0.01, max_connections=3,
                         max_connections_per_client=3) as s:
        stop, barrier = threading.Event(), threading.Barrier(4)
        threads = _hold_streams(s.url, 3, stop, barrier)
        barrier.wait(20)
        r = httpx.post(s.url + "/tokenize", json={"prompt": "x"})  # not even a generation
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert assert_error_body("/tokenize", r)["code"] == "too_many_connections"
        r = httpx.post(s.url + "/v1/messages/count_tokens", json={"model": "scripted", "messages": MSG})
        assert r.status_code == 429 and assert_error_body("/v1/messages/count_tokens", r)["type"] == "rate_limit_error"
        # probes are never counted or refused; health says the server is refusing everyone
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "saturated"
        assert httpx.get(s.url + "/metrics").status_code == 200
        stop.set()
        for t in threads:
            t.join(30)
        deadline = time.monotonic() + 5
        while s.app.state.ctx.engine.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.02)
        assert healthy(s.url)


# ---- per-request timeout --------------------------------------------------------------------------------


def test_request_timeout_aborts_cleanly():
    with scripted_server(max_model_len=2048, max_num_seqs=4, step_delay_s=0.01, request_timeout_s=0.3) as s:
        before = httpx.get(s.url + "/stats").json()["engine"]["aborted"]
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": STORY, "max_tokens": 1000}, timeout=30)
        assert time.monotonic() - t0 < 3
        assert r.status_code == 504
        err = assert_error_body("/v1/chat/completions", r)
        assert err["code"] == "request_timeout" and "timed out after 0.3 s" in err["message"]

        r = httpx.post(s.url + "/v1/messages", timeout=30,
                       json={"model": "scripted", "max_tokens": 1000, "messages": STORY})
        assert r.status_code == 504 and assert_error_body("/v1/messages", r)["type"] == "timeout_error"

        with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=30,
                          json={"messages": STORY, "max_tokens": 1000, "stream": True}) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        finishes = [ln for ln in lines if '"finish_reason":"error"' in ln]
        errors = [ln for ln in lines if ln.startswith('data: {"error"')]
        assert len(finishes) == 1 and len(errors) == 1 and "timed out" in errors[0] and "request_timeout" in errors[0]

        with httpx.stream("POST", s.url + "/v1/completions", timeout=30,
                          json={"prompt": "Tell me a story", "max_tokens": 1000, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"error"' in lines[-3]
        assert lines[-2].startswith('data: {"error"') and "request_timeout" in lines[-2]

        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            stats = httpx.get(s.url + "/stats").json()
            if stats["engine"]["running"] == 0 and stats["engine"]["waiting"] == 0:
                break
            time.sleep(0.02)
        assert stats["engine"]["running"] == 0 and stats["engine"]["aborted"] >= before + 4
        # a short request still fits in the timeout
        ok = httpx.post(s.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 8}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_request_timeout_flag_is_checked():
    import argparse

    from tiermoe.errors import UserError
    from tiermoe.server.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for flags, msg in ([["--request-timeout", "0"], "--request-timeout"],
                       [["--max-connections", "0"], "--max-connections"],
                       [["--tensor-parallel-size", "0"], "--tensor-parallel-size 0: must be >= 1"]):
        args = parser.parse_args(["serve", "--scripted", *flags])
        with pytest.raises(UserError, match=msg):
            args.handler(args)


# ---- API key, CORS, model names -----------------------------------------------------------------------


def test_api_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = app_module.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    with scripted_server(api_key="s3cret-key") as s:
        probes = [
            ({"authorization": "Bearer s3cret-kez"}, 401), ({"authorization": "Bearer s"}, 401),
            ({"authorization": "Bearer " + "s3cret-key" * 100}, 401), ({"x-api-key": "wrong"}, 401), ({}, 401),
            ({"authorization": b"Bearer \xff\xfe"}, 401), ({"authorization": "Basic czNjcmV0LWtleQ=="}, 401),
            ({"authorization": "Bearer s3cret-key"}, 200), ({"x-api-key": "s3cret-key"}, 200),
            ({"authorization": "bearer s3cret-key"}, 200),
        ]
        for headers, status in probes:
            calls.clear()
            r = httpx.post(s.url + "/tokenize", json={"prompt": "x"}, headers=headers)
            assert r.status_code == status, (headers, r.text)
            assert len(calls) == 1 and calls[0][1] == b"s3cret-key"  # every check goes through compare_digest
            if status == 401:
                assert assert_error_body("/tokenize", r)["type"] == "authentication_error"
        r = httpx.post(s.url + "/tokenize?api_key=s3cret-key", json={"prompt": "x"})
        assert r.status_code == 401  # never taken from the URL (it would end up in logs)
        assert httpx.get(s.url + "/openapi.json").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200


def test_cors_is_off_by_default(small):
    origin = {"origin": "https://evil.example"}
    preflight = {**origin, "access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    r = httpx.options(small.url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers and r.status_code in (404, 405)
    r = httpx.post(small.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, headers=origin)
    assert r.status_code == 200 and not any(k.startswith("access-control-") for k in r.headers)
    r = httpx.get(small.url + "/v1/models", headers=origin)
    assert "access-control-allow-origin" not in r.headers


def test_cors_only_for_configured_origins():
    with scripted_server(cors_origins=["https://app.example"], api_key="k") as s:
        pre = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
        ok = httpx.options(s.url + "/v1/chat/completions", headers={"origin": "https://app.example", **pre})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        bad = httpx.options(s.url + "/v1/chat/completions", headers={"origin": "https://evil.example", **pre})
        assert bad.headers.get("access-control-allow-origin") != "https://evil.example"
        r = httpx.get(s.url + "/v1/models", headers={"origin": "https://evil.example", "authorization": "Bearer k"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = httpx.get(s.url + "/v1/models", headers={"origin": "https://app.example", "authorization": "Bearer k"})
        assert "retry-after" in r.headers["access-control-expose-headers"].lower()  # a browser reads it on a 429


PATH_NAMES = ["../../etc/passwd", "/etc/passwd", "..%2f..%2fetc%2fpasswd", "....//....//etc/passwd", "~root/.ssh/id_rsa",
              "file:///etc/passwd", "C:\\Windows\\win.ini", "scripted/../../etc/passwd", "scripted\x00/etc/passwd",
              "\\\\server\\share\\x", "."]


def test_model_name_never_names_a_file(small, tmp_path):
    """A `model` that looks like a path is an unknown model (404) and nothing is opened: an
    audit hook records every file the process opens or lists while the requests run."""
    bait = tmp_path / "bait-model"
    bait.mkdir()
    (bait / "config.json").write_text("{}")
    names = PATH_NAMES + [str(bait), f"../../../../..{bait}"]
    seen: list[str] = []
    active = threading.Event()

    def hook(event, args):
        if active.is_set() and event in ("open", "os.listdir", "os.scandir", "shutil.copyfile", "os.chdir"):
            seen.append(f"{event} {args[0]!r}")

    sys.addaudithook(hook)  # cannot be removed; inert once `active` is cleared
    requests = [
        ("/v1/chat/completions", lambda m: {"model": m, "messages": MSG}),
        ("/v1/completions", lambda m: {"model": m, "prompt": "x"}),
        ("/v1/responses", lambda m: {"model": m, "input": "x"}),
        ("/v1/messages", lambda m: {"model": m, "max_tokens": 4, "messages": MSG}),
        ("/v1/messages/count_tokens", lambda m: {"model": m, "messages": MSG}),
        ("/tokenize", lambda m: {"model": m, "prompt": "x"}),
        ("/detokenize", lambda m: {"model": m, "tokens": [1]}),
    ]
    with httpx.Client(base_url=small.url) as client:
        client.get("/health")  # connection set up before the hook starts watching
        active.set()
        try:
            results = [(path, name, client.post(path, json=body(name))) for name in names for path, body in requests]
        finally:
            active.clear()
    for path, name, r in results:
        assert r.status_code == 404, (path, name, r.status_code, r.text[:200])
        err = assert_error_body(path, r)
        assert err["type"] == "not_found_error" and "does not exist" in err["message"]
        if not path.startswith("/v1/messages"):
            assert err["code"] == "model_not_found"
        assert "root:" not in r.text  # no file content ever comes back
    suspicious = [s for s in seen if "passwd" in s or "bait-model" in s or "id_rsa" in s or "win.ini" in s]
    assert suspicious == [], suspicious
