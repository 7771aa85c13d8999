"""Faults injected under a real server serving a real tiny model from a packed expert store.

Every expert is read from experts.bin on each use (slot and host tiers sized 0), so disk
faults land on the request path: I/O errors, short reads, partial reads, a record corrupted
after start-up. Each affected request fails cleanly (a 503 with an OpenAI / Anthropic error body
naming the fault, or an in-stream error with finish_reason "error"), and the next request is
served normally, with the same text as before the fault. A checksum mismatch also turns /health
unhealthy for good (the files are damaged); an I/O error leaves it healthy. Start-up faults (missing or truncated store files, memory
that cannot be allocated or pinned) end `tiermoe serve` with one line and exit status 2.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import threading
import time

import httpx
import pytest

from reliability_util import ServeProcess, ServerThread, assert_error_body, free_port

PROMPT = [{"role": "user", "content": "Hello there, how are you today? Tell me about the sea and the stars."}]
# greedy: a recovered server must give the reference text again (a left-out temperature samples)
CHAT = {"messages": PROMPT, "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    from tiermoe.store.pack import pack

    out = tmp_path_factory.mktemp("faults") / "store"
    pack(str(tiny_dir("glm4_moe", "bfloat16")), str(out), quant="bf16", progress=False, log=lambda _: None)
    return out


def real_server(path) -> ServerThread:
    """The real engine on `path`, every expert read from disk on each use."""
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import build_engine_core
    from tiermoe.server.app import create_app

    core = build_engine_core(str(path), device="cpu", dtype="bfloat16", max_model_len=512, max_num_seqs=4,
                             options={"gpu_expert_gb": 0, "host_expert_gb": 0})
    server = ServerThread(create_app(AsyncEngine(core), served_model_name="tiny"), log_level="error")
    server.core = core
    return server


@pytest.fixture(scope="module")
def served(store):
    with real_server(store) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200
        s.reference = r.json()["choices"][0]["message"]["content"]
        yield s


def experts(s) -> dict:
    return httpx.get(s.url + "/stats", timeout=30).json()["engine"]["experts"]


def assert_recovered(s, health: int = 200) -> None:
    """The server is healthy (`health`: the status /health answers), nothing is left running or
    reading, and the same request gives the same text as before the fault (state after a failed
    step is intact)."""
    assert httpx.get(s.url + "/health").status_code == health
    r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == s.reference
    engine = httpx.get(s.url + "/stats").json()["engine"]
    assert engine["running"] == 0 and engine["waiting"] == 0
    assert engine["experts"]["disk"]["reads_in_flight"] == 0


def assert_fails_cleanly(s, match: str, code: str = "store_error") -> None:
    """Non-streaming OpenAI and Anthropic requests get a 503 error body naming the fault (the
    store's, not the request's); a stream gets an in-band error and finish_reason "error", then
    [DONE]."""
    r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 503, r.text[:300]
    err = assert_error_body("/v1/chat/completions", r)
    assert err["code"] == code and match in err["message"], err

    r = httpx.post(s.url + "/v1/messages", json={"model": "tiny", "max_tokens": 12, "messages": PROMPT}, timeout=60)
    assert r.status_code == 503 and match in assert_error_body("/v1/messages", r)["message"]

    with httpx.stream("POST", s.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    assert len(errors) == 1 and match in errors[0]["message"] and finishes == ["error"], chunks[-3:]


def test_disk_io_error(served, monkeypatch):
    def eio(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)
    assert_fails_cleanly(served, "I/O error reading layer")
    assert httpx.get(served.url + "/health").status_code == 200  # still up while the disk is failing
    monkeypatch.undo()
    assert_recovered(served)


def test_short_read(served, monkeypatch):
    real = os.preadv

    def short(fd, buffers, offset):
        return 0 if offset >= 3 * 12288 else real(fd, buffers, offset)  # as if the file ended there

    monkeypatch.setattr(os, "preadv", short)
    assert_fails_cleanly(served, "short read of layer")
    monkeypatch.undo()
    assert_recovered(served)


def test_partial_reads_are_completed(served, monkeypatch):
    real = os.preadv
    calls = []

    def piecewise(fd, buffers, offset):  # the kernel may return fewer bytes than asked
        calls.append(offset)
        return real(fd, [buffers[0][:4096]], offset)

    monkeypatch.setattr(os, "preadv", piecewise)
    reads = experts(served)["disk"]["reads"]
    r = httpx.post(served.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == served.reference
    assert experts(served)["disk"]["reads"] > reads and len(calls) >= 3 * (experts(served)["disk"]["reads"] - reads)


def test_intermittent_faults_under_concurrent_load(served, monkeypatch):
    """Every 7th read fails while 8 clients hammer the server: each request either completes
    with the reference text or fails with a clean error; none hangs; the server recovers."""
    real = os.preadv
    count = [0]
    lock = threading.Lock()

    def flaky(fd, buffers, offset):
        with lock:
            count[0] += 1
            fail = count[0] % 7 == 0
        if fail:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", flaky)
    outcomes = []

    def client():
        for _ in range(3):
            r = httpx.post(served.url + "/v1/chat/completions", json=CHAT, timeout=60)
            if r.status_code == 200:
                outcomes.append("ok" if r.json()["choices"][0]["message"]["content"] == served.reference else "WRONG")
            else:
                err = assert_error_body("/v1/chat/completions", r)
                outcomes.append("failed" if r.status_code == 503 and "I/O error" in err["message"] else f"BAD {r.status_code}")

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 24 and set(outcomes) <= {"ok", "failed"}, outcomes
    assert "failed" in outcomes
    monkeypatch.undo()
    assert_recovered(served)


def test_corrupted_record_after_start(store, tmp_path):
    """A byte flipped in experts.bin while serving: every request that needs that record fails
    with the checksum error (never a wrong answer), again and again; once the byte is put
    back the same request succeeds with the original text."""
    from tiermoe.store.records import load_manifest

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    with real_server(copy) as s:
        backend = s.core.model.expert_backend.store
        used: list[int] = []
        fetch = backend.fetch_records

        def recording(layer, ids):
            used.extend(backend.key(layer, e) for e in ids)
            return fetch(layer, ids)

        backend.fetch_records = recording
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200
        s.reference = r.json()["choices"][0]["message"]["content"]
        backend.fetch_records = fetch
        rec = load_manifest(copy).records[used[0]]  # a record this prompt certainly needs
        path = copy / "experts.bin"
        with open(path, "r+b") as f:
            f.seek(rec.offset + 100)
            original = f.read(1)
            f.seek(rec.offset + 100)
            f.write(bytes([original[0] ^ 0xFF]))
        for _ in range(2):
            assert_fails_cleanly(s, f"checksum mismatch for {rec.name()}", code="store_corrupt")
        assert "tiermoe verify" in httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=60).json()["error"]["message"]
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "store_corrupt"
        assert f"checksum mismatch for {rec.name()}" in health.json()["error"]["message"]
        with open(path, "r+b") as f:
            f.seek(rec.offset + 100)
            f.write(original)
        assert_recovered(s, health=503)  # served again; /health names the damage until a restart


# ---- start-up faults: one line, exit status 2 ----------------------------------------------------


def _serve_main(capsys, *args) -> tuple[int, str]:
    from tiermoe.cli import main

    rc = main(["serve", *args, "--device", "cpu", "--port", str(free_port()), "--log-level", "error"])
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize("fault,expect", [
    ("no-bin", "packed expert store without its experts.bin"),
    ("no-manifest", "packed expert store without its manifest.json"),
    ("truncated", "truncated"),
])
def test_missing_or_truncated_store_file(store, tmp_path, capsys, fault, expect):
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    if fault == "no-bin":
        (copy / "experts.bin").unlink()
    elif fault == "no-manifest":
        (copy / "manifest.json").unlink()
    else:
        os.truncate(copy / "experts.bin", 10_000)
    rc, err = _serve_main(capsys, str(copy))
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("tiermoe: error:") and expect in err, err


def test_pinning_refused_is_one_line(store, capsys, monkeypatch):
    """A host buffer that cannot be pinned (torch's error when RLIMIT_MEMLOCK is exhausted)."""
    import tiermoe.store.tiers as tiers

    def refuse(nbytes, *, pin=False, align=4096):
        raise RuntimeError("CUDA error: cudaHostRegister failed: operation not permitted (memlock limit)")

    monkeypatch.setattr(tiers, "aligned_buffer", refuse)
    rc, err = _serve_main(capsys, str(store))
    assert rc == 2 and len(err.splitlines()) == 1 and "cannot pin (page-lock) host memory" in err and "ulimit -l" in err, err


def test_absurd_kv_cache_is_one_line(store, capsys):
    for size in ("100000", "1e30"):
        rc, err = _serve_main(capsys, str(store), "--kv-cache-gb", size)
        assert rc == 2 and len(err.splitlines()) == 1 and "cannot allocate memory" in err and "--kv-cache-gb" in err, err


@pytest.mark.slow
def test_sigterm_drains_real_model_under_zero_memlock(store):
    """`tiermoe serve` on the packed store with RLIMIT_MEMLOCK 0 (nothing to pin on CPU, so it
    starts); SIGTERM mid-stream lets the stream finish, then the process exits 0."""
    # a drain long enough for the 120 tokens on a loaded 2-core machine (the default 30 s cut them off there once)
    server = ServeProcess([str(store), "--device", "cpu", "--max-num-seqs", "2", "--log-level", "warning",
                           "--served-model-name", "tiny", "--drain-timeout", "150"])
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, hard))  # inherited by the child
    try:
        server.start()
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
    result = {}
    try:
        assert server.proc.poll() is None, server.stderr

        def consume():
            finish, n = None, 0
            with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                              json={"messages": PROMPT, "max_tokens": 120, "stream": True, "ignore_eos": True,
                                    "stream_options": {"include_usage": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            n += 1
                            finish = chunk["choices"][0]["finish_reason"] or finish
                        if chunk.get("usage"):
                            result["tokens"] = chunk["usage"]["completion_tokens"]
                        if n == 3:
                            result["started"] = time.monotonic()
            result["finish"], result["chunks"] = finish, n

        t = threading.Thread(target=consume)
        t.start()
        deadline = time.monotonic() + 30
        while "started" not in result and time.monotonic() < deadline:
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        t.join(160)
        rc = server.proc.wait(160)
    finally:
        server.stop()
    assert result.get("finish") == "length" and result.get("tokens") == 120, result
    assert rc == 0, server.stderr[-2000:]
    assert "Traceback" not in server.stderr
