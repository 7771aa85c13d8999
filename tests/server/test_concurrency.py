"""Continuous batching through the server: concurrent streams, disconnects, stream pacing."""

import threading
import time

import httpx
import openai
import pytest

from server_harness import start_server
from tiermoe.engine.scripted import STORY

N_TOKENS = 40


@pytest.fixture(scope="module")
def paced(tokenizer):
    """A server whose every engine step takes 4 ms, like a small real model."""
    with start_server(tokenizer, core_kwargs={"max_num_seqs": 16, "step_delay_s": 0.004}) as s:
        yield s


def _stream_story(url, results, key, max_tokens=N_TOKENS):
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    t0 = time.monotonic()
    text, usage, finish = "", None, None
    messages = [{"role": "user", "content": f"Tell me a story ({key})"}]
    for ch in c.chat.completions.create(model="scripted", messages=messages, max_tokens=max_tokens, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    results[key] = (text, usage, finish, time.monotonic() - t0)


def test_sixteen_concurrent_streams_with_exact_usage(paced, tokenizer):
    single = {}
    _stream_story(paced.url, single, "solo")
    results = {}
    threads = [threading.Thread(target=_stream_story, args=(paced.url, results, i)) for i in range(16)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    wall = time.monotonic() - t0
    assert len(results) == 16
    expected = tokenizer.decode(tokenizer.encode(STORY * 2, add_special_tokens=False)[:N_TOKENS])
    for key, (text, usage, finish, _) in results.items():
        messages = [{"role": "user", "content": f"Tell me a story ({key})"}]
        prompt = httpx.post(paced.url + "/tokenize", json={"messages": messages}).json()
        assert finish == "length" and text == expected
        assert usage.completion_tokens == N_TOKENS and usage.prompt_tokens == prompt["count"]
    single_rate = N_TOKENS / single["solo"][3]
    aggregate = 16 * N_TOKENS / wall
    assert aggregate > 2 * single_rate, (aggregate, single_rate)


def test_disconnect_mid_stream_frees_the_sequence(paced):
    c = openai.OpenAI(base_url=paced.url + "/v1", api_key="x", max_retries=0)
    before = httpx.get(paced.url + "/stats").json()["engine"]["aborted"]
    stream = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Tell me a story"}],
                                       max_tokens=2000, stream=True)
    it = iter(stream)
    for _ in range(5):
        next(it)
    running = httpx.get(paced.url + "/stats").json()
    assert running["engine"]["running"] == 1 and running["server"]["requests_running"] == 1
    stream.close()  # the client goes away
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = httpx.get(paced.url + "/stats").json()
        if stats["engine"]["running"] == 0:
            break
        time.sleep(0.01)
    assert stats["engine"]["running"] == 0 and stats["engine"]["aborted"] == before + 1
    assert stats["server"]["requests_running"] == 0
    assert stats["engine"]["generated_tokens"] < 1000  # stopped early, not run to max_tokens


def test_non_streaming_disconnect_aborts(paced):
    before = httpx.get(paced.url + "/stats").json()["engine"]["aborted"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(paced.url + "/v1/chat/completions", timeout=0.3,
                   json={"model": "scripted", "messages": [{"role": "user", "content": "Tell me a story"}],
                         "max_tokens": 2000})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = httpx.get(paced.url + "/stats").json()
        if stats["engine"]["aborted"] == before + 1 and stats["engine"]["running"] == 0:
            break
        time.sleep(0.02)
    assert stats["engine"]["aborted"] == before + 1 and stats["engine"]["running"] == 0


def test_stream_delivery_is_paced_not_bursty(paced):
    """The field's delivery rule, scaled to a short stream: >= 40 % of the text by the time
    midpoint, and no end-of-answer burst (the last 10 % of the time carries <= 20 % of it)."""
    c = openai.OpenAI(base_url=paced.url + "/v1", api_key="x", max_retries=0)
    arrivals = []
    t0 = time.monotonic()
    for ch in c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Tell me a story"}],
                                        max_tokens=250, stream=True):
        if ch.choices and ch.choices[0].delta.content:
            arrivals.append((time.monotonic() - t0, len(ch.choices[0].delta.content)))
    total = sum(n for _, n in arrivals)
    end = arrivals[-1][0]
    by_mid = sum(n for t, n in arrivals if t <= end / 2)
    tail = sum(n for t, n in arrivals if t >= 0.9 * end)
    assert end > 0.5 and len(arrivals) > 50  # tokens arrived spread out, not in a few lumps
    assert by_mid >= 0.4 * total and tail <= 0.2 * total
