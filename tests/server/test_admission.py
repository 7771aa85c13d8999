"""--max-queue holds under a burst: admission reserves the slots at once, and every path gives them back.

Between admission and the engine, a handler awaits rendering, tokenizing and schema checks. When
admission only read the engine's count, a burst of simultaneous requests all passed against the
same number (9 of 16 admitted for a limit of 4). Here the encode is slowed so that every request
of the burst is admitted before any reaches the engine, which is the race, made certain."""

import asyncio
import threading
import time

import httpx
import openai
import pytest

from server_harness import start_server

LIMIT = 4  # max_num_seqs 2 + max_queue 2


@pytest.fixture
def slow_server(tokenizer):
    with start_server(tokenizer, core_kwargs={"max_num_seqs": 2, "step_delay_s": 0.02}, max_queue=2) as s:
        ctx = s.app.state.ctx
        real_encode = ctx.encode

        async def slow_encode(*args, **kwargs):
            await asyncio.sleep(0.5)  # every request of the burst is past admission before any is queued
            return await real_encode(*args, **kwargs)

        ctx.encode = slow_encode
        yield s


def _burst(fn, n):
    results = [None] * n
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as exc:  # noqa: BLE001 -- the test inspects it
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _settled(s):
    """Wait until nothing is reserved or running; the /stats view of it."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        stats = httpx.get(s.url + "/stats").json()
        if stats["admitting"] == 0 and s.engine.num_unfinished == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"slots still held: {stats['admitting']} reserved, {s.engine.num_unfinished} in the engine")


@pytest.mark.parametrize("stream", [False, True])
def test_a_burst_admits_at_most_the_limit_and_the_rest_get_429(slow_server, stream):
    c = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def chat(i):
        r = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": f"Tell me a story {i}"}],
                                      max_tokens=20, stream=stream)
        return list(r) if stream else r

    results = _burst(chat, 16)
    ok = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(ok) + len(refused) == 16, [r for r in results if isinstance(r, Exception)]
    assert 1 <= len(ok) <= LIMIT
    for e in refused:
        assert e.body["code"] == "queue_full" and e.body["type"] == "rate_limit_error" and "param" in e.body
        assert e.response.headers["retry-after"] == "1"
        in_flight = int(e.body["message"].split("(")[1].split()[0])
        assert in_flight <= LIMIT, e.body["message"]
    _settled(slow_server)


def test_slots_come_back_on_errors_and_disconnects(slow_server):
    """Admitted requests that never reach the engine give their slots back: a 400 after admission
    (context too long), and a client gone while its prompt is tokenized."""
    c = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    too_long = [{"role": "user", "content": "word " * 5000}]

    def over(i):
        return c.chat.completions.create(model="scripted", messages=too_long, max_tokens=4)

    results = _burst(over, 6)
    assert sum(isinstance(r, openai.BadRequestError) for r in results) >= 1
    assert all(isinstance(r, (openai.BadRequestError, openai.RateLimitError)) for r in results)
    for _ in range(6):  # each gives up while the server is still tokenizing
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(slow_server.url + "/v1/completions", timeout=0.2,
                       json={"model": "scripted", "prompt": "Tell me a story", "max_tokens": 4})
    assert _settled(slow_server)["admitting"] == 0
    ctx = slow_server.app.state.ctx
    assert ctx.reserved == 0
    # the full limit is usable again
    results = _burst(lambda i: c.completions.create(model="scripted", prompt=f"hi {i}", max_tokens=2), LIMIT)
    assert all(not isinstance(r, Exception) for r in results), results
