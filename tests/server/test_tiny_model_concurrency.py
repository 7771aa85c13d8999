"""16 concurrent streaming clients against the real engine with a tiny CPU model: every stream
completes with exact usage counts, batching beats a single client, and a client that
disconnects mid-stream frees its sequence and KV pages (visible in /stats)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
TOKENS = 24
MSG = [{"role": "user", "content": "Tell me a story about the sea."}]
FORCE_LENGTH = {"ignore_eos": True}  # untrained model: run every stream to max_tokens


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    from server_harness import ServerThread
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import build_engine_core
    from tiermoe.server.app import create_app

    core = build_engine_core(str(tiny_dir("qwen3_moe")), device="cpu", dtype="float32", max_model_len=512,
                             max_num_seqs=16)
    app = create_app(AsyncEngine(core), served_model_name="tiny", max_model_len=512)
    with ServerThread(app) as server:
        yield server, core


def _stream(client) -> tuple[int, int]:
    chunks = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=TOKENS, stream=True,
                                            stream_options={"include_usage": True}, extra_body=FORCE_LENGTH)
    text_events, usage = 0, None
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            text_events += 1
        if c.usage is not None:
            usage = c.usage
    return usage.completion_tokens, usage.prompt_tokens


def test_sixteen_streams_complete_with_exact_usage_and_batch(tiny_server):
    server, _ = tiny_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    _stream(client)  # warm-up
    t0 = time.perf_counter()
    single, _ = _stream(client)
    single_rate = single / (time.perf_counter() - t0)

    results: list[tuple[int, int]] = []
    lock = threading.Lock()

    def worker():
        r = _stream(client)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    elapsed = time.perf_counter() - t0
    assert len(results) == 16
    assert all(completion == TOKENS for completion, _ in results)
    assert len({prompt for _, prompt in results}) == 1
    aggregate = 16 * TOKENS / elapsed
    assert aggregate > single_rate, (aggregate, single_rate)


def test_disconnect_frees_sequence_and_pages(tiny_server):
    server, core = tiny_server
    body = {"model": "tiny", "messages": MSG, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break  # leave mid-stream: the context manager closes the connection
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            stats = http.get(server.url + "/stats").json()
            engine = stats.get("engine", stats)
            if engine.get("running") == 0 and engine.get("kv_pages_free") == engine.get("kv_pages_total"):
                break
            time.sleep(0.1)
        assert engine["running"] == 0
        assert engine["kv_pages_free"] == engine["kv_pages_total"]
        assert engine["aborted"] >= 1
